"""Data-parallel RL: one RL iteration of the nano policy on N GPUs through the command the `rl_iter`
rule runs (`kpipe launch --gpus N --module kpipe.infra.jobs -- <settings file>`: FSDP2, one process per GPU, each evaluating on its
own GPU), then the rows and metrics it wrote.

    python3 -m checks.gpu rl_fsdp --gpus 2      # a 2-GPU machine, ~2 minutes

Fails when the launch fails or a row is gathered twice.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

from checks.gpu.harness import Report, Section

TITLE = "Data-parallel (FSDP2) RL check"
KERNEL_TASKS = ((1, 19), (1, 88))


def add_options(parser: argparse._ArgumentGroup) -> None:
    parser.add_argument("--gpus", type=int, default=2)


def launch(report: Report, args: argparse.Namespace) -> None:
    """The rl_iter rule's command exits 0 on N GPUs and rank 0 gathers each process's rows once."""
    from kpipe.data.io import read_table, write_table
    from kpipe.data.kernelbench import load_problems, shrink_sizes
    from kpipe.infra.jobs import JOBS_MODULE, write_job_file
    from kpipe.infra.launch import launch_command
    from kpipe.train.rl import rl_job
    from kpipe.train.tiny_model import build_tiny_model

    problems = {(p.level, p.problem_id): p for p in load_problems("main")}
    with tempfile.TemporaryDirectory(prefix="kpipe-rl-fsdp-") as tmp:
        root = Path(tmp)
        queries = [{"query_id": f"kb-L{level}-{pid}", "source": "check", "source_id": str(pid), "level": level,
                    "name": problems[(level, pid)].name, "reference_src": shrink_sizes(problems[(level, pid)].code, 1024),
                    "reference_hash": "", "contaminated": False} for level, pid in KERNEL_TASKS]
        write_table(queries, root / "queries.parquet", "queries")
        model = build_tiny_model(root / "base", seed=0, size="tiny")
        settings = {"prompts_per_step": 2, "rollouts_per_prompt": 4, "max_turns": 1, "max_tokens": 64,
                    "steps_per_iteration": 2, "mixed_precision": "bf16"}
        gym = {"backend": "pool", "cache": None,
               "protocol": {"correct_trials": 2, "perf_trials": 10, "warmup": 2}}
        # what rule rl_iter's job of several processes runs: its settings in one file (kpipe.infra.jobs)
        job_file = write_job_file(root / "rl.job.json", rl_job, {
            "queries": str(root / "queries.parquet"), "init_model": str(model), "model_out": str(root / "out" / "model"),
            "trajectories": str(root / "out" / "traj.parquet"), "metrics": str(root / "out" / "metrics.parquet"),
            "scratch": str(root / "scratch"), "state_out": str(root / "out" / "state"), "run": "fsdp-check",
            "iteration": 0, "rl": settings, "gym": gym})
        command = launch_command(args.gpus, [str(job_file)], module=JOBS_MODULE)
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True)
        wall = time.perf_counter() - started
        log = (done.stdout + done.stderr)[-6000:]
        report.line(f"`{' '.join(command[2:])}` (rl_job) on {args.gpus} GPUs: exit {done.returncode} in {wall:.0f} s", "")
        report.expect(done.returncode == 0, f"the launch exited {done.returncode}")
        if done.returncode == 0:
            rows = read_table(root / "out" / "traj.parquet", "trajectories").to_pandas()
            metrics = read_table(root / "out" / "metrics.parquet", "train_metrics").to_pandas()
            keys = rows[["task_id", "sample", "turn", "step"]].drop_duplicates() if "step" in rows else rows
            # rank 0 gathers each process's rows once
            report.expect(len(keys) == len(rows), f"{len(rows) - len(keys)} duplicated trajectory rows")
            report.line(f"rows {len(rows)} (distinct {len(keys)}), statuses {rows.status.value_counts().to_dict()}")
            report.table("step", "name", "value")
            wanted = ("loss", "grad_norm", "reward_mean", "rows", "trained_rows", "gen_s", "eval_s", "train_s", "step_s",
                      "rollout_ppl", "train_ppl")
            for _, row in metrics[metrics.name.isin(wanted)].iterrows():
                report.row(row["step"], row["name"], f"{row['value']:.4g}")
            report.line("", "Exported model files: " + ", ".join(sorted(p.name for p in (root / "out" / "model").iterdir())))
        report.line("", "```", log[-3000:], "```")


SECTIONS = (Section("launch", 120, launch, gpus=2),)
