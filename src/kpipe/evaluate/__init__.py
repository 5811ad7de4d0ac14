"""Evaluation stages: KernelBench evaluation against eager and torch.compile, and sequential test-time scaling."""
