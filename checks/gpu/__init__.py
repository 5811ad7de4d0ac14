"""kpipe's GPU checks: one harness (``checks.gpu.harness``) and one module per check, listed here in
the order the whole suite runs them (``python -m checks.gpu --list``)."""

CHECKS = ("gym", "gym_paths", "confinement", "rl_learns", "rl", "sft", "rl_fsdp", "dag", "rl_generation", "vllm", "paper_units")
