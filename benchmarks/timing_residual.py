#!/usr/bin/env python
"""Where does the spread left under kgym-4 come from: the process, the build, or the child's hooks?

    . scripts/device_env.sh && python benchmarks/timing_residual.py --out residual.json

Under kgym-4 (the reference timed in chunks beside the candidate, the GPU's drift divided out) the
same candidate's speedup still spreads 1.01-1.04 over five pool evaluations on the ~2 ms GEMM tasks,
while four rounds in one process agree within 1.005-1.018 (docs/gpu-results/timing_noise_2026-11-25_H100.md).
This separates what differs between two evaluations, per task, in `--processes` fresh interpreters:
each builds the candidate `--builds` times (a dummy allocation of a different size before each build,
so its tensors land elsewhere) and times each build `--retimes` times with kgym-4's paired timing,
every other re-timing with the candidate child's launch hook recording (``instrument.recording``).

Prints, per task, for the judge's estimate (``kpipe.gym.evaluation.drift_corrected``) and for a mean
over chunks (which repeats better but is not robust to a candidate that skips work on some calls),
the max/min of the speedup over: re-timings of one build, builds in one process, processes, and
hooked against plain; its coefficient of variation over every timing, and how often five timings
drawn from them spread beyond 1.03 (issue 14's bound). Every per-trial time goes
to `--out`, so estimators can be compared on the same trials without the GPU (``--replay``).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from noise_runs import loaded_pairs, probe_parser, run_probe, share_spread_beyond  # noqa: E402


def measure(tasks: list[str], builds: int, retimes: int) -> dict[str, Any]:
    """In this process: per task, `builds` builds of the candidate, each timed `retimes` times."""
    import torch

    from kpipe.gym import instrument
    from kpipe.gym.protocol import Protocol
    from kpipe.gym.timing import Clocks, l2_flush_buffer, time_forward, timed_region

    protocol = Protocol()
    clocks = Clocks("cuda")
    l2 = l2_flush_buffer(protocol, "cuda")
    instrument.install()
    out: dict[str, Any] = {}
    for pair in loaded_pairs(tasks):
        reference_model = pair.reference_model()
        rows = []
        for b in range(builds):
            shift = torch.empty((b + 1) * 37 * 1024 * 1024, dtype=torch.uint8, device="cuda")  # moves what comes next
            model, input_sets = pair.candidate_model(), pair.input_sets()
            with torch.no_grad():
                model(*input_sets[0])
            torch.cuda.synchronize()
            for r in range(retimes):
                hooked = r % 2 == 1
                timing = time_forward(model, input_sets, protocol.perf_trials, protocol.warmup, clocks, l2, set(), lambda outs: [],
                                      instrument.recording if hooked else None, reference=reference_model,
                                      reference_trials=protocol.paired_reference_trials, **timed_region(protocol))
                rows.append({"build": b, "retime": r, "hooked": hooked, "candidate": timing["ms"],
                             "reference": timing.get("reference_ms", [])})
            del model, input_sets, shift
            torch.cuda.empty_cache()
        out[pair.task] = rows
        del reference_model
        torch.cuda.empty_cache()
    return out


def judged_speedup(row: dict[str, Any], statistic: str) -> float:
    """The speedup from one paired timing, with this timing's own reference median as the solo
    timing (the pool uses the reference child's; any constant gives the same spread away from the
    cap). `statistic`: ``"judge"``, the judge's (``drift_corrected``: the median of the corrected
    trials), or ``"chunk mean"``, the mean over chunks of each candidate chunk's trimmed mean over
    its reference chunk's, which repeats better but lets a candidate that skips its work on a
    minority of calls gain (so the judge does not use it)."""
    from kpipe.gym.evaluation import drift_corrected, median, paired_chunks
    from kpipe.gym.protocol import Protocol

    if not row["reference"]:
        return 1.0 / median(row["candidate"])
    if statistic == "judge":  # in the order the calls ran (kgym-6's chunks are drawn; kgym-4's fixed)
        timing = {"ms": row["candidate"], "reference_ms": row["reference"], "order": row.get("order")}
        return median(row["reference"]) / median(drift_corrected(row["candidate"], timing, {"eager": {"ms": row["reference"]}}, Protocol())[0])
    chunks = paired_chunks(row["candidate"], row["reference"])
    return 1.0 / statistics.fmean(trimmed_mean(trials) / trimmed_mean(beside) for trials, beside in chunks)


def trimmed_mean(values: list[float]) -> float:
    """The mean without the lowest and the highest value."""
    ordered = sorted(values)
    return statistics.fmean(ordered[1:-1] if len(ordered) > 2 else ordered)


def spread(values: list[float]) -> str:
    return f"{max(values) / min(values):.3f}" if len(values) > 1 else "-"


STATISTICS = ("judge", "chunk mean")


def report(data: dict[str, list[list[dict[str, Any]]]]) -> list[str]:
    """`data`: task -> one list of rows per process; one line per task and paired statistic."""
    lines = ["| task | estimate | re-timings of one build (worst) | builds in one process (worst) | processes (first timing each) "
             "| hooked / plain (median) | CV over all timings | P(5 timings spread > 1.03) | candidate ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for task, processes in data.items():
        for statistic in STATISTICS:
            same_build, across_builds, firsts, hook_ratio, cand_ms, every = [], [], [], [], [], []
            for rows in processes:
                speedups = [judged_speedup(row, statistic) for row in rows]
                every += speedups
                firsts.append(speedups[0])
                per_build: dict[int, list[float]] = {}
                for value, row in zip(speedups, rows):
                    per_build.setdefault(row["build"], []).append(value)
                same_build += [max(v) / min(v) for v in per_build.values() if len(v) > 1]
                across_builds.append(max(v[0] for v in per_build.values()) / min(v[0] for v in per_build.values()))
                plain = [s for s, row in zip(speedups, rows) if not row["hooked"]]
                hooked = [s for s, row in zip(speedups, rows) if row["hooked"]]
                if plain and hooked:
                    hook_ratio.append(statistics.median(hooked) / statistics.median(plain))
                cand_ms += [statistics.median(row["candidate"]) for row in rows]
            over = share_spread_beyond(every)
            lines.append(f"| {task} | {statistic} | {max(same_build, default=1.0):.3f} | {max(across_builds):.3f} | {spread(firsts)} | "
                         f"{statistics.median(hook_ratio) if hook_ratio else float('nan'):.3f} | "
                         f"{statistics.pstdev(every) / statistics.fmean(every):.2%} | {over:.2f} | {min(cand_ms):.3f}-{max(cand_ms):.3f} |")
    return lines


def main() -> None:
    parser = probe_parser(__doc__, "L1_1,L2_9,L2_12,L2_59,L2_63,L2_76,L2_86", 5)
    parser.add_argument("--builds", type=int, default=2)
    parser.add_argument("--retimes", type=int, default=4)
    args = parser.parse_args()
    run_probe(__file__, args, ["--tasks", args.tasks, "--builds", str(args.builds), "--retimes", str(args.retimes)],
              lambda: measure(args.tasks.split(","), args.builds, args.retimes), report,
              f"{args.processes} processes x {args.builds} builds x {args.retimes} timings (kgym-4 paired, judged speedup)")


if __name__ == "__main__":
    main()
