"""Every touch of Snakemake's internals, in one module (tests/test_snakemake_adapter.py pins each).

The Snakefile reads only Snakemake's documented interface (`config`, `workflow.basedir`, rules,
`onstart`...); what it needs beyond that goes through these functions, so a Snakemake upgrade
breaks here and in that test, not across the rule files. The pin (pyproject.toml, environment.yml,
`min_version` in workflow/Snakefile) is `TESTED_SNAKEMAKE`: a floor, tested by `make
test-snakemake-floor` (that test, the lint and the default DAG's plan under the floor's Snakemake),
and the next major version, untested; `make test` tests the newest version the floor allows.

- `until_stops_after_chained_rules` replaces `snakemake.dag.DAG.in_until`. Upstream behaviour it
  works around (no upstream issue names it; the symptom is the one of snakemake/snakemake#823):
  `DAG.finish` marks no dependent of a finished `--until` job ready ("Skip jobs that are marked as
  until jobs"), so with every job of a chained rule (rl_iter: iteration k reads iteration k-1)
  counted as an until job, iteration 1 waits for ever and Snakemake stops with "BUG: Out of jobs
  ready to be started" after iteration 0. A target rule cannot replace it: `--until RULE` is the
  user's command (README, Reruns), for any rule.
- `label_interrupted_jobs` wraps `DAG.check_incomplete`, `DAG.update_needrun`, `Reason.__str__` and
  `Reason.get_names`. Upstream behaviour: with `--rerun-incomplete` (both profiles) Snakemake adds the
  incomplete outputs to `DAG.forcefiles`, so a job rerun after an interruption is labelled "Forced
  execution", as if the user had forced it; Snakemake's own "Incomplete output files" wording is
  never reached.
- `command_line_config`, `runs_here`, `is_main_process`, `resource_total` and `default_resource_total`
  read and set `Workflow` attributes that Snakemake does not document (`config_settings`,
  `resource_settings`, `remote_exec`, `is_main_process`, `global_resources`, `register_resource`).
"""

from __future__ import annotations

from typing import Any

# [floor, first untested): 9.16 lacks what `resource_total` reads (global resources held as plain ints)
TESTED_SNAKEMAKE = ("9.17", "10")
_PATCHED = "_kpipe_until_frontier"
_INTERRUPTED = "_kpipe_interrupted_outputs"  # DAG attribute: the outputs rerun-incomplete forced


def until_stops_after_chained_rules() -> None:
    """Narrow `DAG.in_until` to a chained rule's last jobs: `--until` stops after the rule, as it
    means, and the chain inside the rule runs (idempotent: each parse of the Snakefile calls it)."""
    from snakemake.dag import DAG

    if getattr(DAG.in_until, _PATCHED, False):
        return
    in_until = DAG.in_until

    def frontier_only(dag: Any, job: Any) -> bool:
        return in_until(dag, job) and not any(dependent.rule is job.rule for dependent in dag.depending[job])

    setattr(frontier_only, _PATCHED, True)
    DAG.in_until = frontier_only


def label_interrupted_jobs() -> None:
    """A job rerun because an interrupted run left its outputs incomplete says "Incomplete output
    files: ..." (Snakemake's words) in `snakemake -n` and the run's log, not "Forced execution";
    a rule the user forced (--forcerun) keeps "Forced execution". Idempotent."""
    from snakemake.dag import DAG
    from snakemake.jobs import Reason

    if getattr(DAG.check_incomplete, _PATCHED, False):
        return
    check_incomplete, update_needrun = DAG.check_incomplete, DAG.update_needrun
    reason_text, reason_names = Reason.__str__, Reason.get_names

    async def remembering(dag: Any) -> None:
        forced_before = set(dag.forcefiles)
        await check_incomplete(dag)
        setattr(dag, _INTERRUPTED, set(dag.forcefiles) - forced_before)

    async def labelling(dag: Any, *args: Any, **kwargs: Any) -> None:
        await update_needrun(dag, *args, **kwargs)
        interrupted = getattr(dag, _INTERRUPTED, set())
        for job in dag.needrun_jobs() if interrupted else ():
            reason = dag.reason(job)
            files = interrupted.intersection(job.output)
            if reason.forced and files and job.rule not in dag.forcerules:
                reason._incomplete_output = files

    def unforced(method: Any) -> Any:
        def call(reason: Any) -> Any:
            if not (reason.forced and reason._incomplete_output):
                return method(reason)
            reason.forced = False
            try:
                return list(method(reason)) if method is reason_names else method(reason)
            finally:
                reason.forced = True
        return call

    for function in (remembering, labelling):
        setattr(function, _PATCHED, True)
    DAG.check_incomplete, DAG.update_needrun = remembering, labelling
    Reason.__str__, Reason.get_names = unforced(reason_text), unforced(reason_names)


def command_line_config(workflow: Any) -> dict[str, Any]:
    """The `--config KEY=VALUE` pairs as given, before Snakemake merged them into `config`
    (nested values arrive there as strings, which the Snakefile parses)."""
    return dict(workflow.config_settings.config)


def runs_here(workflow: Any) -> bool:
    """A run on this machine, not a cluster. `workflow.local_exec` cannot tell while the Snakefile
    is parsed (the executor plugin is set after parsing), but a remote executor needs --jobs
    (`nodes`), which a local run turns into --cores; a job run by a remote executor (exec mode
    `remote`) parses the Snakefile too, on its own node."""
    return workflow.resource_settings.nodes is None and not workflow.remote_exec


def is_main_process(workflow: Any) -> bool:
    """The Snakemake process that plans and locks the run, not a job's own Snakemake (a cluster
    job or a group's subprocess parses the Snakefile too, and takes no lock)."""
    return bool(workflow.is_main_process)


def resource_total(workflow: Any, name: str) -> int | None:
    """The run's total of resource `name` (--resources, a profile, or a registered default);
    None where nobody gave one (Snakemake answers a `Resource` holding None)."""
    total = workflow.global_resources.get(name).value
    return None if total is None else int(total)


def default_resource_total(workflow: Any, name: str, total: int) -> None:
    """Set resource `name`'s total where nobody gave one (a given total wins)."""
    if name not in workflow.global_resources:
        workflow.register_resource(name, total)
