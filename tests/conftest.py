"""Shared test setup: Triton runs through its CPU interpreter; no GPU is assumed."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
