"""checks/gpu/dag.py on a CPU: Snakemake's log read into jobs, the most jobs at once, the jobs' timeline,
the logs kept, and timed regions that overlap on one device (what the GPU run's report rests on)."""

from __future__ import annotations

import json
import tarfile
import textwrap
from pathlib import Path

import pytest

import checks.gpu.dag
from checks.gpu.dag import (Job, archive_logs, most_at_once, overlapping_timed_regions, parse_snakemake_log, timeline_rows,
                            trace_summary)

LOG = textwrap.dedent("""\
    Building DAG of jobs...
    Provided resources: api=Resource("api", 4), gpu_slots=Resource("gpu_slots", 4)
    [Thu Nov 26 07:37:45 2026]
    localrule ingest_tasks:
        output: results/tasks/tasks.parquet
        jobid: 2
        resources: tmpdir=/tmp
    Shell command: None
    [Thu Nov 26 07:37:45 2026]
    rule distill:
        output: results/x.parquet
        log: logs/distill/shard-0.log
        jobid: 7
        reason: Missing output files: results/x.parquet
        wildcards: shard=0
        resources: tmpdir=/tmp, gpu_slots=1, gpu=1
    Shell command: None
    [Thu Nov 26 07:37:46 2026]
    Finished jobid: 2 (Rule: ingest_tasks)
    1 of 3 steps (33%) done
    [Thu Nov 26 07:37:47 2026]
    rule sft:
        jobid: 9
        resources: tmpdir=/tmp, gpu_slots=4, gpu=1
    [Thu Nov 26 07:37:55 2026]
    Finished jobid: 7 (Rule: distill)
    [Thu Nov 26 07:38:05 2026]
    Finished jobid: 9 (Rule: sft)
    3 of 3 steps (100%) done
""")


def test_the_log_gives_each_job_its_rule_times_gpu_slots_and_log() -> None:
    jobs, first, last = parse_snakemake_log(LOG)
    assert [(job.jobid, job.rule, job.seconds, job.gpu_slots, job.log) for job in jobs] == [
        (2, "ingest_tasks", 1.0, 0, None), (7, "distill", 10.0, 1, "logs/distill/shard-0.log"), (9, "sft", 18.0, 4, None)]
    assert last - first == 20.0


def test_a_job_never_finished_has_no_seconds() -> None:
    jobs, _, _ = parse_snakemake_log(LOG.split("[Thu Nov 26 07:38:05 2026]")[0])
    assert {job.rule: job.seconds for job in jobs}["sft"] is None


def test_most_at_once_counts_overlapping_jobs_only() -> None:
    jobs = [Job(1, "a", 0, 10, 0), Job(2, "b", 5, 12, 1), Job(3, "c", 6, 7, 1), Job(4, "d", 12, 20, 1)]
    assert most_at_once(jobs) == 3
    assert most_at_once([Job(1, "a", 0, 5, 0), Job(2, "b", 5, 9, 0)]) == 1  # one ends as the next starts
    assert most_at_once([Job(1, "a", 0, None, 0), Job(2, "b", 3, 4, 0)]) == 2


def test_overlapping_timed_regions_per_device() -> None:
    apart = {"GPU-a": [(0.0, 1.0), (1.0, 2.0), (0.0, 1.0)], "GPU-b": [(0.5, 1.5)]}  # a cached copy repeats a span
    assert overlapping_timed_regions(apart) == []
    found = overlapping_timed_regions({"GPU-a": [(0.0, 3.0), (1.0, 1.5), (2.0, 4.0)]})
    assert len(found) == 2 and all(text.startswith("GPU-a: [0.000, 3.000]") for text in found)


def test_the_timeline_gives_each_job_by_its_start_in_seconds_from_the_run_s_first_line() -> None:
    jobs, first, _ = parse_snakemake_log(LOG)
    jobs.append(Job(8, "distill", first + 1, None, 1, "logs/distill/shard-1.log"))  # still running
    assert timeline_rows(jobs, first) == [("ingest_tasks", "0", "1", "1"), ("distill (shard-0)", "0", "10", "10"),
                                          ("distill (shard-1)", "1", "", ""), ("sft", "2", "20", "18")]


def test_the_jobs_and_the_service_s_logs_and_the_trace_are_kept_beside_the_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "repo"
    for name in ("logs/distill/run=default/shard-0.log", "results/.gym/service-1.log", "results/tables/x.md"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(name)
    monkeypatch.setattr(checks.gpu.dag, "ROOT", root)
    monkeypatch.setattr(checks.gpu.dag, "RESULTS", root / "results")
    trace = tmp_path / "trace.jsonl"
    with tarfile.open(archive_logs(tmp_path / "logs.tar.gz", trace)) as tar:  # no trace: the logs alone
        assert sorted(tar.getnames()) == ["logs/distill/run=default/shard-0.log", "results/.gym/service-1.log"]
    trace.write_text("{}\n")
    with tarfile.open(archive_logs(tmp_path / "logs.tar.gz", trace)) as tar:
        assert sorted(tar.getnames()) == ["gym-trace.jsonl", "logs/distill/run=default/shard-0.log", "results/.gym/service-1.log"]


def test_the_trace_summary_counts_reference_runs_and_each_judge_s_first_evaluation(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    assert trace_summary(trace) == ["- the judges' trace: no evaluation traced"]
    records = [
        {"judge_pid": 1, "started_unix": 10.0, "wall_s": 9.0, "reference_s": 4.0, "reference_reused": False},
        {"judge_pid": 1, "started_unix": 20.0, "wall_s": 3.0, "reference_s": 0.0, "reference_reused": True},
        {"judge_pid": 2, "started_unix": 11.0, "wall_s": 7.0, "reference_s": 2.0, "reference_reused": False},
        {"judge_pid": 2, "started_unix": 19.0, "wall_s": 1.0, "status": "compilation_error"},  # no child run
    ]
    trace.write_text("".join(json.dumps(record) + "\n" for record in records))
    assert trace_summary(trace) == [
        "- the judges' trace: 4 evaluations by 2 judges, 5.0 s each on average (longest 9.0); 2 reference runs, "
        "3.0 s each on average (longest 4.0); each judge's first evaluation 8.0 s on average (longest 9.0)"]


def test_the_run_s_config_overlays_come_after_the_gpu_config_and_before_the_rerun_s() -> None:
    from argparse import Namespace

    from checks.gpu.dag import snakemake_argv

    options = Namespace(cpu=False, cores=16, overlay=["more-workers.yaml"], snakemake_args="--keep-going")
    argv = snakemake_argv(options, "window.yaml")
    assert argv[argv.index("--cores"):] == ["--cores", "16", "--configfile", "config/gpu.yaml", "more-workers.yaml",
                                            "window.yaml", "--keep-going"]
    options.cpu = True  # a CPU run has no GPU config under its overlays
    assert snakemake_argv(options)[-4:] == ["16", "--configfile", "more-workers.yaml", "--keep-going"]
