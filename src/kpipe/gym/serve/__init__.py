"""Serving evaluations: warm workers and their pool (``worker``, ``pool``), the HTTP service and its
client (``service``, ``client``), a Snakemake run's one service (``run_service``), the result cache
(``cache``), batches (``batch``), the Ray backend (``distributed``) and their commands (``scale_cli``).
"""
