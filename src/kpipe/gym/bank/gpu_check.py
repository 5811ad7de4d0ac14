"""Check the bank on a GPU at full KernelBench size: status of every solution, speedups of the legit ones.

    python -m kpipe.gym.bank.gpu_check [--variants legit,wrong_index,...] [--trials 50] [--json out.json]

A quick bank-level check, not the evaluator's protocol: CUDA-event timing of the median of
`trials` runs after warm-up, the L2 cache flushed before each run, under `no_grad`, eager
reference, `torch.compile`d reference and candidate on the same GPU, close together in time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm import tqdm

from kpipe.data.kernelbench import select_problems
from kpipe.gym.bank import VARIANTS, list_solutions
from kpipe.gym.bank.harness import check_isolated, load_module

L2_FLUSH_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class Row:
    key: str
    status: str
    expected_status_full: str
    eager_ms: float | None = None
    compile_ms: float | None = None
    candidate_ms: float | None = None
    detail: str = ""

    @property
    def speedup_eager(self) -> float | None:
        return self.eager_ms / self.candidate_ms if self.eager_ms and self.candidate_ms else None

    @property
    def speedup_compile(self) -> float | None:
        return self.compile_ms / self.candidate_ms if self.compile_ms and self.candidate_ms else None


def median_ms(run: Callable[[], Any], trials: int, warmup: int = 5) -> float:
    """Median CUDA-event time of `run`, L2 flushed before each trial."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    for _ in range(warmup):
        run()
    times = []
    for _ in range(trials):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_task(reference_src: str, candidate_src: str, trials: int) -> tuple[float, float, float]:
    """Median ms of eager reference, compiled reference and candidate, all built from seed 0."""
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        reference = load_module(reference_src, "bank_reference", Path(tmp))
        candidate = load_module(candidate_src, "bank_candidate", Path(tmp))
        torch.manual_seed(0)
        reference_model = reference.Model(*reference.get_init_inputs()).cuda()
        torch.manual_seed(0)
        candidate_model = candidate.ModelNew(*reference.get_init_inputs()).cuda()
        torch.manual_seed(0)
        inputs = [v.cuda() if isinstance(v, torch.Tensor) else v for v in reference.get_inputs()]
        compiled = torch.compile(reference_model)
        eager_ms = median_ms(lambda: reference_model(*inputs), trials)
        compile_ms = median_ms(lambda: compiled(*inputs), trials)
        candidate_ms = median_ms(lambda: candidate_model(*inputs), trials)
    torch.cuda.empty_cache()
    return eager_ms, compile_ms, candidate_ms


def check_bank(variants: list[str], trials: int) -> list[Row]:
    problems = {(p.level, p.problem_id): p.code for p in select_problems("main", [1, 2])}
    rows = []
    solutions = [s for s in list_solutions() if s.variant in variants]
    for solution in tqdm(solutions, desc="bank on GPU"):
        reference_src = problems[(solution.level, solution.problem_id)]
        outcome = check_isolated(reference_src, solution.source, device="cuda", timeout_s=600)
        row = Row(solution.key, outcome.status, solution.expected_status_full, detail=outcome.detail[:200])
        if solution.variant == "legit" and outcome.status == "pass":
            eager_ms, compile_ms, candidate_ms = time_task(reference_src, solution.source, trials)
            row = Row(solution.key, outcome.status, solution.expected_status_full, eager_ms, compile_ms, candidate_ms)
        rows.append(row)
    return rows


def format_table(rows: list[Row]) -> str:
    from tabulate import tabulate

    def fmt(value: float | None) -> str:
        return "" if value is None else f"{value:.3f}"

    body = [
        [r.key, r.status, "ok" if r.status == r.expected_status_full else f"EXPECTED {r.expected_status_full}",
         fmt(r.eager_ms), fmt(r.compile_ms), fmt(r.candidate_ms), fmt(r.speedup_eager), fmt(r.speedup_compile), r.detail[:60]]
        for r in rows
    ]
    headers = ["solution", "status", "check", "eager ms", "compile ms", "triton ms", "x eager", "x compile", "detail"]
    return tabulate(body, headers=headers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated variants to run")
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check needs a CUDA GPU (TRITON_INTERPRET must be unset)")
    rows = check_bank(args.variants.split(","), args.trials)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(format_table(rows))
    if args.json:
        payload = [asdict(r) | {"speedup_eager": r.speedup_eager, "speedup_compile": r.speedup_compile} for r in rows]
        args.json.write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
