"""Reporting stages: the paper's tables, figures and the trajectory viewer."""
