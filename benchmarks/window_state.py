#!/usr/bin/env python
"""What sets the offset each timing window keeps under kgym-4: GPU state, placement, the host, or
too few reference trials?

    . scripts/device_env.sh && python benchmarks/window_state.py --out window_state.json

benchmarks/timing_residual.py found that the judged speedup of one build moves by 0.6-1.0 % (CV)
between timing windows, and that the offset holds for the whole window: no estimator over the
window's trials and no finer pairing removes it. This times, per task in one process, `--rounds`
rounds of `--variants` of kgym-4's paired timing, one window each, in turn (so all sample the
same stretch of GPU state):

- ``kgym-4``: ``time_forward`` as kgym-4 pairs (100 candidate trials in chunks of 10, 50 reference trials,
  the host synchronising after every trial);
- ``kgym-6``: ``time_forward(back_to_back=True)``, as the protocol now pairs (chunks of random length,
  the host synchronising only between chunks; the saved runs 1 and 2 hold its forerunner, ``no host
  sync inside chunks``, a loop of this file with kgym-4's fixed chunks, which kgym-6 replaced);
- ``100 reference trials``: the same with a reference chunk as long as the candidate's;
- ``placement shuffled``: the allocator's cache emptied and a block of random size held before the
  window, so the outputs and intermediates of both programs land elsewhere;
- ``GPU held 0.2 ms`` / ``GPU held 1 ms``: kgym-4 with the GPU kept busy (``torch.cuda._sleep``) that
  long after the flush, before the start event: the host has then queued the forward's first kernels
  before the GPU reaches the start, so the region holds no wait for the host.

NVML is sampled during every window (SM and memory clocks, power, GPU and memory temperature). The
report gives, per variant, the coefficient of variation of the judged speedup over the windows and how
often five windows spread beyond 1.03 (issue 14's bound), and, for kgym-4, how the speedup's log
correlates with each NVML reading and with time. Every per-trial time and reading goes to `--out`
(``--replay`` re-prints the report without the GPU).
"""

from __future__ import annotations

import math
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from noise_runs import loaded_pairs, probe_parser, run_probe, share_spread_beyond  # noqa: E402

VARIANTS = ("kgym-4", "kgym-6", "100 reference trials", "placement shuffled", "GPU held 0.2 ms", "GPU held 1 ms")
DEFAULT_VARIANTS = ("kgym-4", "kgym-6", "GPU held 0.2 ms", "GPU held 1 ms")
READINGS = ("sm_mhz", "mem_mhz", "power_w", "gpu_c", "mem_c")


class Telemetry:
    """NVML readings every `period_s` while a window runs; their means per window."""

    def __init__(self, period_s: float = 0.005) -> None:
        import pynvml

        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.period_s = period_s
        self.samples: list[tuple[float, ...]] = []
        self._stop = threading.Event()

    def read(self) -> tuple[float, ...]:
        nvml, handle = self.nvml, self.handle
        memory_c = float("nan")
        try:
            field = nvml.nvmlDeviceGetFieldValues(handle, [nvml.NVML_FI_DEV_MEMORY_TEMP])[0]
            if field.nvmlReturn == 0:
                memory_c = float(field.value.uiVal)
        except nvml.NVMLError:
            pass
        return (float(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)), float(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_MEM)),
                nvml.nvmlDeviceGetPowerUsage(handle) / 1e3, float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)), memory_c)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.read())
            time.sleep(self.period_s)

    def __enter__(self) -> Telemetry:
        self.samples = []
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def means(self) -> dict[str, float]:
        return {name: statistics.fmean(s[i] for s in self.samples) for i, name in enumerate(READINGS)} if self.samples else {}


def gpu_cycles(ms: float) -> int:
    """``torch.cuda._sleep``'s argument for about `ms` at the GPU's maximum SM clock."""
    import pynvml

    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    return int(ms * 1e3 * pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM))


def measure(tasks: list[str], rounds: int, variants: list[str]) -> dict[str, Any]:
    """In this process: per task, `rounds` rounds of `variants`, one window each."""
    import torch

    from kpipe.gym.protocol import Protocol
    from kpipe.gym.timing import Clocks, flush_l2, l2_flush_buffer, time_forward, timed_region

    protocol = Protocol()
    clocks = Clocks("cuda")
    l2 = l2_flush_buffer(protocol, "cuda")
    telemetry = Telemetry()
    held_flush = {ms: (lambda cycles=gpu_cycles(ms): (flush_l2(l2), torch.cuda._sleep(cycles))) for ms in (0.2, 1.0)}
    shuffle = random.Random(0)
    started = time.perf_counter()
    out: dict[str, Any] = {}
    for pair in loaded_pairs(tasks):
        reference_model, model, input_sets = pair.reference_model(), pair.candidate_model(), pair.input_sets()
        rows = []
        for r in range(rounds):
            for variant in variants:
                held = None
                if variant == "placement shuffled":
                    torch.cuda.empty_cache()
                    held = torch.empty(shuffle.randrange(1, 512) * 1024 * 1024, dtype=torch.uint8, device="cuda")
                with telemetry:
                    at = time.perf_counter() - started
                    reference_trials = protocol.perf_trials if variant == "100 reference trials" else protocol.paired_reference_trials
                    flush = held_flush[0.2] if variant == "GPU held 0.2 ms" else held_flush[1.0] if variant == "GPU held 1 ms" else None
                    paired = time_forward(model, input_sets, protocol.perf_trials, protocol.warmup, clocks, l2, set(), lambda outs: [],
                                          reference=reference_model, reference_trials=reference_trials, flush=flush,
                                          back_to_back=variant == "kgym-6", **timed_region(protocol))
                    timing = {"candidate": paired["ms"], "reference": paired.get("reference_ms", []), "order": paired.get("order")}
                rows.append({"round": r, "variant": variant, "at_s": at, **timing, **telemetry.means()})
                del held
        out[pair.task] = rows
        del model, reference_model, input_sets
        torch.cuda.empty_cache()
    return out


def judged(row: dict[str, Any]) -> float:
    """The window's speedup as the judge takes it, its own reference median as the solo time."""
    from timing_residual import judged_speedup

    return judged_speedup(row, "judge")


def correlation(xs: list[float], ys: list[float]) -> float:
    if len(xs) < 3 or any(math.isnan(x) for x in xs) or statistics.pstdev(xs) == 0 or statistics.pstdev(ys) == 0:
        return float("nan")
    return statistics.correlation(xs, ys)


def report(data: dict[str, list[list[dict[str, Any]]]]) -> list[str]:
    """`data`: task -> one list of rows per process."""
    lines = ["| task | variant | speedup (median) | CV over windows | P(5 windows spread > 1.03) | candidate ms | reference ms | windows |",
             "|---|---|---|---|---|---|---|---|"]
    links = ["| task | " + " | ".join(f"corr(log speedup, {name})" for name in (*READINGS, "time")) + " | readings (min-max) |",
             "|---|" + "---|" * (len(READINGS) + 2)]
    for task, processes in data.items():
        for variant in dict.fromkeys(row["variant"] for rows in processes for row in rows):
            windows = [row for rows in processes for row in rows if row["variant"] == variant]
            values = [judged(row) for row in windows]
            lines.append(f"| {task} | {variant} | {statistics.median(values):.3f} | {statistics.pstdev(values) / statistics.fmean(values):.2%} | "
                         f"{share_spread_beyond(values):.2f} | {statistics.median(statistics.median(r['candidate']) for r in windows):.3f} | "
                         f"{statistics.median(statistics.median(r['reference']) for r in windows):.3f} | {len(values)} |")
        # per process, so a slow drift between processes does not make a correlation
        per_reading: dict[str, list[float]] = {name: [] for name in (*READINGS, "time")}
        for rows in processes:
            kgym = [row for row in rows if row["variant"] == "kgym-4" and row.get("sm_mhz") is not None]
            logs = [math.log(judged(row)) for row in kgym]
            for name in READINGS:
                per_reading[name].append(correlation([row[name] for row in kgym], logs))
            per_reading["time"].append(correlation([row["at_s"] for row in kgym], logs))
        every = [row for rows in processes for row in rows]
        ranges = ", ".join(f"{name} {min(row[name] for row in every):.0f}-{max(row[name] for row in every):.0f}"
                           for name in READINGS if every and name in every[0] and not math.isnan(every[0][name]))
        links.append(f"| {task} | " + " | ".join(", ".join(f"{c:+.2f}" for c in per_reading[name]) for name in (*READINGS, "time"))
                     + f" | {ranges} |")
    return lines + ["", "kgym-4 windows, one correlation per process:", ""] + links


def main() -> None:
    parser = probe_parser(__doc__, "L2_9,L2_12,L2_59,L2_63,L2_76,L2_86", 2)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma-separated, of: {', '.join(VARIANTS)}")
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    run_probe(__file__, args, ["--tasks", args.tasks, "--rounds", str(args.rounds), "--variants", args.variants],
              lambda: measure(args.tasks.split(","), args.rounds, variants), report,
              f"{args.processes} processes x {args.rounds} rounds x {len(variants)} variants")


if __name__ == "__main__":
    main()
