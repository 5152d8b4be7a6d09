"""Leaves every layer shares: value checks (`validation`), the plan and step types (`plan_types`)
and the collapse of known third-party start-up warnings (`quiet_start`).

Nothing here imports from the rest of the project.
"""
