"""GPU check of data-parallel RL: one RL iteration of the nano policy on N GPUs through the
command the `rl_iter` rule runs (`kpipe launch --gpus N -- train rl ...`: FSDP2, one process per
GPU, each evaluating on its own GPU), then the rows and metrics it wrote.

    PYTHONPATH=$PWD/src python3 scripts/gpu_check_rl_fsdp.py --gpus 2      # a 2-GPU machine, ~2 minutes

Writes $OUT/rl_fsdp_check.md when $OUT is set; exit status 1 when the launch fails or a row is gathered twice.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gpu_harness

KERNEL_TASKS = ((1, 19), (1, 88))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=2)
    args = parser.parse_args()

    from kpipe.data.io import read_table, write_table
    from kpipe.data.kernelbench import load_problems, shrink_sizes
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
        command = [sys.executable, "-m", "kpipe.cli", "launch", "--gpus", str(args.gpus), "--", "train", "rl",
                   "--queries", str(root / "queries.parquet"), "--init-model", str(model),
                   "--model-out", str(root / "out" / "model"), "--trajectories", str(root / "out" / "traj.parquet"),
                   "--metrics", str(root / "out" / "metrics.parquet"), "--scratch", str(root / "scratch"),
                   "--run", "fsdp-check", "--settings", json.dumps(settings), "--gym", json.dumps(gym)]
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True)
        wall = time.perf_counter() - started
        log = (done.stdout + done.stderr)[-6000:]
        lines = [f"# Data-parallel RL check ({args.gpus} GPUs)", "", gpu_harness.facts_line(gpu_harness.device_facts()),
                 "", f"`{' '.join(command[2:7])} train rl ...`: exit {done.returncode} in {wall:.0f} s", ""]
        failures = [f"the launch exited {done.returncode}"] if done.returncode else []
        if done.returncode == 0:
            rows = read_table(root / "out" / "traj.parquet", "trajectories").to_pandas()
            metrics = read_table(root / "out" / "metrics.parquet", "train_metrics").to_pandas()
            keys = rows[["task_id", "sample", "turn", "step"]].drop_duplicates() if "step" in rows else rows
            if len(keys) < len(rows):  # rank 0 gathers each process's rows once
                failures.append(f"{len(rows) - len(keys)} duplicated trajectory rows")
            lines += [f"rows {len(rows)} (distinct {len(keys)}), statuses {rows.status.value_counts().to_dict()}", "",
                      "| step | name | value |", "|---|---|---|"]
            wanted = ("loss", "grad_norm", "reward_mean", "rows", "trained_rows", "gen_s", "eval_s", "train_s", "step_s",
                      "rollout_ppl", "train_ppl")
            for _, row in metrics[metrics.name.isin(wanted)].iterrows():
                lines.append(f"| {row['step']} | {row['name']} | {row['value']:.4g} |")
            lines += ["", "Exported model files: " + ", ".join(sorted(p.name for p in (root / "out" / "model").iterdir()))]
        lines += ["", "```", log[-3000:], "```"]
    report = "\n".join(lines)
    print(report)
    gpu_harness.write_report("rl_fsdp_check", report + "\n")
    return gpu_harness.exit_status(failures)


if __name__ == "__main__":
    sys.exit(main())
