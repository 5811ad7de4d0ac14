#!/usr/bin/env python
"""Which way of timing the reference beside the candidate repeats best, and how far is it from the
ratio of the two timed alone?

    . scripts/device_env.sh && python benchmarks/pairing_methods.py --out pairing.json

kgym-4 times 50 reference trials in chunks of 5 after every 10 candidate trials, each chunk after an
untimed call (``kpipe.gym.timing.interleaving``); what it leaves is each timing window's own
offset (benchmarks/timing_residual.py). Trials interleaved one by one tracked the GPU more closely
in one process (docs/gpu-results/timing_noise_2026-11-25_H100.md) but slowed launch-bound kernels
after a GEMM call; the pool pairs only candidates of at least 1 ms now. This compares, per task, in
`--processes` fresh interpreters, `--rounds` rounds of each method in turn (so all sample the same
stretch of GPU state) and of the two programs timed alone:

- ``chunks of 10``: kgym-4 (10 candidate trials, 5 reference trials, an untimed call at each switch);
- ``pairs``: 2 candidate trials, 1 reference trial, no untimed calls;
- ``alternate``: one candidate trial, one reference trial (100 of each), no untimed calls.

Prints per method the judge's speedup (each chunk of candidate trials divided by its reference
chunk's median over the reference's median alone, then the median), its coefficient of variation
over every round, how often five rounds spread beyond 1.03, and its ratio to the speedup of the two
timed alone (mean over rounds): the bias a method's switching adds.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from noise_runs import loaded_pairs, probe_parser, run_probe, share_spread_beyond  # noqa: E402

# name: (candidate trials per chunk, reference trials, untimed call at each switch)
METHODS = {"chunks of 10": (10, 50, True), "pairs": (2, 50, False), "alternate": (1, 100, False)}


def measure(tasks: list[str], rounds: int) -> dict[str, Any]:
    import torch

    from kpipe.gym.protocol import Protocol
    from kpipe.gym.timing import Clocks, l2_flush_buffer, time_forward, timed_region

    protocol = Protocol()
    clocks = Clocks("cuda")
    l2 = l2_flush_buffer(protocol, "cuda")
    out: dict[str, Any] = {}
    for pair in loaded_pairs(tasks):
        models = {"reference": pair.reference_model(), "candidate": pair.candidate_model()}
        input_sets = pair.input_sets()

        def timed(forward: Any, **paired: Any) -> dict[str, Any]:
            return time_forward(forward, input_sets, protocol.perf_trials, protocol.warmup, clocks, l2, set(), lambda outs: [],
                                **paired, **timed_region(protocol))

        rows = []
        for _ in range(rounds):
            row: dict[str, Any] = {"alone": {name: timed(model)["ms"] for name, model in models.items()}}
            for method, (chunk, reference_trials, switch_calls) in METHODS.items():
                result = timed(models["candidate"], reference=models["reference"], reference_trials=reference_trials,
                               chunk=chunk, switch_calls=switch_calls)
                row[method] = {"candidate": result["ms"], "reference": result["reference_ms"]}
            rows.append(row)
        out[pair.task] = rows
        models.clear()
        input_sets.clear()
        torch.cuda.empty_cache()
    return out


def judged(candidate: list[float], reference: list[float], chunk: int) -> float:
    from kpipe.gym.evaluation import median, paired_chunks
    from kpipe.gym.timing import interleaving

    solo = median(reference)
    order = interleaving(len(candidate), len(reference), chunk)
    corrected = [ms / (median(beside) / solo) for trials, beside in paired_chunks(candidate, reference, order) for ms in trials]
    return solo / median(corrected)


def report(data: dict[str, list[dict[str, Any]]]) -> list[str]:
    """`data`: task -> every round of every process."""
    lines = ["| task | method | speedup (median) | CV over rounds | P(5 rounds spread > 1.03) | vs the two timed alone |",
             "|---|---|---|---|---|---|"]
    for task, rows in data.items():
        alone = statistics.fmean(statistics.median(r["alone"]["reference"]) / statistics.median(r["alone"]["candidate"]) for r in rows)
        for method, (chunk, _, _) in METHODS.items():
            values = [judged(r[method]["candidate"], r[method]["reference"], chunk) for r in rows]
            over = share_spread_beyond(values)
            lines.append(f"| {task} | {method} | {statistics.median(values):.3f} | {statistics.pstdev(values) / statistics.fmean(values):.2%} | "
                         f"{over:.2f} | {statistics.fmean(values) / alone:.3f} |")
        lines.append(f"| {task} | the two timed alone | {alone:.3f} | | | |")
    return lines


def main() -> None:
    parser = probe_parser(__doc__, "L1_1,L2_9,L2_12,L2_59,L2_76,L2_86", 3)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    run_probe(__file__, args, ["--tasks", args.tasks, "--rounds", str(args.rounds)], lambda: measure(args.tasks.split(","), args.rounds),
              report, f"{args.processes} processes x {args.rounds} rounds",
              merge=lambda per_process: {task: [row for rows in processes for row in rows] for task, processes in per_process.items()})


if __name__ == "__main__":
    main()
