"""Leaves every layer shares: value checks (`validation`), the plan and step types (`plan_types`),
the collapse of known third-party start-up warnings (`quiet_start`), and the lifetime of a rank's
processes (`process_lifetime`).

Nothing here imports from the rest of the project.
"""
