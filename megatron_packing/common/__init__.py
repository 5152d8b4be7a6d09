"""Leaves every layer shares: value checks (`validation`) and the plan and step types (`plan_types`).

Nothing here imports from the rest of the project.
"""
