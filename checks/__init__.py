"""Checks that need hardware the test suite does not have (``checks.gpu``: one harness, one module per check)."""
