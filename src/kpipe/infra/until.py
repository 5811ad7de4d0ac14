"""`snakemake --until RULE` for a rule whose jobs chain (rl_iter: iteration k reads iteration k-1).

Snakemake's scheduler never marks the dependents of a finished `--until` job ready (DAG.finish), so
with every job of a chained rule counted as an until job, iteration 1 waits for ever and Snakemake
stops with "BUG: Out of jobs ready to be started" after iteration 0. Here a job of an until rule
counts as one only where no job of the same rule reads it: the run stops after the rule, as
`--until` means, and the chain inside the rule runs.
"""

from __future__ import annotations

from typing import Any

_PATCHED = "_kpipe_until_frontier"


def until_stops_after_chained_rules() -> None:
    """Narrow `DAG.in_until` to a chained rule's last jobs (idempotent: each parse of the Snakefile calls it)."""
    from snakemake.dag import DAG

    if getattr(DAG.in_until, _PATCHED, False):
        return
    in_until = DAG.in_until

    def frontier_only(dag: Any, job: Any) -> bool:
        return in_until(dag, job) and not any(dependent.rule is job.rule for dependent in dag.depending[job])

    setattr(frontier_only, _PATCHED, True)
    DAG.in_until = frontier_only
