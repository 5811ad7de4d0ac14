"""kpipe: reproducibility pipeline for RL of Triton kernel generation (Dr. Kernel)."""

__version__ = "0.1.0"
