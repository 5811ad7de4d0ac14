#!/usr/bin/env python
"""KernelGym from a cold start on a GPU machine, through every path users take (issue 13).

    . scripts/device_env.sh && python scripts/gpu_check_gym_paths.py --sections pool,service,placement,caches
    . scripts/device_env.sh && python scripts/gpu_check_gym_paths.py --sections eval

Before anything runs, ``TRITON_CACHE_DIR`` and ``TORCHINDUCTOR_CACHE_DIR`` point at new empty
directories and ``~/.triton`` is moved aside, so nothing compiled by an earlier process helps.

Sections (each prints a Markdown table; the report goes to $OUT/gym_paths.md and the rows to
$OUT/gym_paths.json when $OUT is set):

- ``pool``: every bank solution (legit and every variant, full KernelBench ``main`` sizes)
  through ``kpipe gym eval-batch`` (the pool: what distillation, RL and evaluation use);
- ``service``: the same pairs through ``kpipe gym serve`` and the HTTP client;
- ``eval``: the same pairs through the fresh-interpreter path of ``kpipe gym eval``
  (``evaluate()`` in this process; plus the CLI itself on three pairs);
- ``placement``: one worker per visible GPU; every result's device (UUID from inside the
  child) is its worker's GPU, all GPUs were used, no two timed regions overlapped on one GPU,
  and the same kernel's speedup agrees across GPUs within 3 %;
- ``caches``: the cost of the compile-cache layout, cold (first evaluation of a task in a new
  worker: torch.compile and Triton from nothing) and warm (the next ones), and a candidate that
  plants junk and slowed "compiled" code in every cache it can find: the compile baseline and a
  legit evaluation afterwards are unchanged.

Every path must give the bank's expected full-size status, and all paths the same status per
pair. Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-c", "from kpipe.cli import main; main()"]
SECTIONS = ("pool", "service", "eval", "placement", "caches")


def cold_start() -> dict[str, str]:
    """Fresh, empty compile caches for this process and everything it starts."""
    fresh = {name: tempfile.mkdtemp(prefix=f"cold-{name.lower()}-") for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}
    os.environ.update(fresh)
    home_triton = Path.home() / ".triton"
    if home_triton.exists():
        home_triton.rename(home_triton.with_name(f".triton.aside-{int(time.time())}"))
    return fresh


def gpus() -> list[dict[str, str]]:
    if not shutil.which("nvidia-smi"):
        return []
    out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,pci.bus_id,name", "--format=csv,noheader"],
                         capture_output=True, text=True, check=True).stdout
    return [dict(zip(("index", "uuid", "pci", "name"), (c.strip() for c in line.split(",")))) for line in out.strip().splitlines()]


class GpuPoller(threading.Thread):
    """Polls nvidia-smi: which process ran on which GPU (by UUID)."""

    def __init__(self, interval_s: float = 0.3) -> None:
        super().__init__(daemon=True)
        self.interval_s = interval_s
        self.seen: dict[str, set[int]] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            out = subprocess.run(["nvidia-smi", "--query-compute-apps=gpu_uuid,pid", "--format=csv,noheader"],
                                 capture_output=True, text=True).stdout
            for line in out.strip().splitlines():
                if "," in line:
                    uuid, pid = (c.strip() for c in line.split(",", 1))
                    self.seen.setdefault(uuid, set()).add(int(pid))
            self.stop.wait(self.interval_s)


SIZE_CAP: int | None = None  # --size-cap: a CPU smoke test of this script (statuses then differ)


def bank_pairs(limit: int | None) -> list[dict[str, Any]]:
    from kpipe.data.kernelbench import select_problems, shrink_sizes
    from kpipe.gym.bank import list_solutions

    references = {(p.level, p.problem_id): shrink_sizes(p.code, SIZE_CAP) if SIZE_CAP else p.code for p in select_problems("main", [1, 2])}
    pairs = [
        {"key": s.key, "reference_src": references[(s.level, s.problem_id)], "candidate_src": s.source, "expected": s.expected_status_full}
        for s in list_solutions()
    ]
    return pairs[:limit] if limit else pairs


def protocol_args(perf_trials: int, baseline: str = "eager") -> list[str]:
    return ["--baseline", baseline, "--correct-trials", "5", "--perf-trials", str(perf_trials), "--timeout", "180"]


def run_pool(pairs: list[dict[str, Any]], perf_trials: int, work: Path) -> tuple[list[dict[str, Any]], float]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    batch = work / "pairs.parquet"
    pq.write_table(pa.table({"reference_src": [p["reference_src"] for p in pairs], "candidate_src": [p["candidate_src"] for p in pairs]}), batch)
    output = work / "pool.parquet"
    started = time.monotonic()
    subprocess.run([*CLI, "gym", "eval-batch", "--input", str(batch), "--output", str(output), "--cache", str(work / "pool-cache.sqlite"),
                    "--reuse-reference", *protocol_args(perf_trials)], check=True)
    return pq.read_table(output).to_pylist(), time.monotonic() - started


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_service(pairs: list[dict[str, Any]], perf_trials: int, work: Path) -> tuple[list[dict[str, Any]], float]:
    from kpipe.gym.client import GymClient

    port = free_port()
    started = time.monotonic()
    server = subprocess.Popen([*CLI, "gym", "serve", "--port", str(port), "--cache", str(work / "service-cache.sqlite"),
                               "--reuse-reference", *protocol_args(perf_trials)])
    try:
        client = GymClient(f"http://127.0.0.1:{port}")
        for _ in range(600):
            try:
                client.health()
                break
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.5)
        results = client.evaluate_many([(p["reference_src"], p["candidate_src"]) for p in pairs])
        rows = [r.to_row() if hasattr(r, "to_row") else dict(r) for r in results]
        client.close()
        return rows, time.monotonic() - started
    finally:
        server.terminate()
        server.wait(timeout=60)


def run_eval(pairs: list[dict[str, Any]], perf_trials: int, work: Path) -> tuple[list[dict[str, Any]], float]:
    """The fresh-interpreter path of ``kpipe gym eval``: in this process for every pair (one
    reference run per task, as --reuse-reference does), and the CLI itself on three pairs."""
    from kpipe.gym import Protocol, evaluate

    protocol = Protocol(baseline="eager", correct_trials=5, perf_trials=perf_trials, timeout_s=180)
    started = time.monotonic()
    rows = []
    for pair in pairs:
        try:
            rows.append(evaluate(pair["reference_src"], pair["candidate_src"], protocol, reuse_reference=True).to_row())
        except Exception as exc:  # noqa: BLE001 - a reference failure is a row too
            rows.append({"status": "reference_error", "diagnostic": str(exc)})
    elapsed = time.monotonic() - started
    for pair, row in list(zip(pairs, rows))[:: max(1, len(pairs) // 3)][:3]:
        ref, cand = work / "ref.py", work / "cand.py"
        ref.write_text(pair["reference_src"])
        cand.write_text(pair["candidate_src"])
        out = subprocess.run([*CLI, "gym", "eval", "--reference", str(ref), "--candidate", str(cand), "--json", *protocol_args(perf_trials)],
                             capture_output=True, text=True)
        cli_status = json.loads(out.stdout.strip().splitlines()[-1])["status"] if out.returncode == 0 else f"exit {out.returncode}"
        row["cli_status"] = cli_status
    return rows, elapsed


def status_table(pairs: list[dict[str, Any]], by_path: dict[str, list[dict[str, Any]]]) -> tuple[list[str], bool]:
    paths = list(by_path)
    lines = ["| pair | expected | " + " | ".join(paths) + " | agree |", "|---|---|" + "---|" * (len(paths) + 1)]
    ok = True
    for i, pair in enumerate(pairs):
        statuses = [by_path[p][i].get("status", "?") for p in paths]
        cli = [by_path[p][i].get("cli_status") for p in paths if by_path[p][i].get("cli_status")]
        agree = all(s == pair["expected"] for s in statuses + cli)
        ok &= agree
        cells = [s + ("" if s == pair["expected"] else f" ({by_path[p][i].get('diagnostic', '')[:60]})") for s, p in zip(statuses, paths)]
        lines.append(f"| {pair['key']} | {pair['expected']} | " + " | ".join(c.replace("|", "/").replace("\n", " ") for c in cells)
                     + f" | {'yes' if agree else 'NO'}{' (CLI: ' + cli[0] + ')' if cli else ''} |")
    return lines, ok


def placement_check(perf_trials: int, work: Path) -> tuple[list[str], bool]:
    """One worker per GPU over a batch of legit kernels (each twice): placement, overlap, agreement."""
    from kpipe.gym import Protocol
    from kpipe.gym.pool import GymPool

    devices = gpus()
    legit = [p for p in bank_pairs(None) if p["key"].endswith("/legit")][:6]
    jobs = [(p["reference_src"], p["candidate_src"] + f"\n# copy {k}\n") for p in legit for k in range(2 * len(devices))]
    poller = GpuPoller()
    poller.start()
    protocol = Protocol(baseline="eager", correct_trials=5, perf_trials=perf_trials, timeout_s=180)
    with GymPool(protocol, progress=False) as pool:
        worker_gpu = {w["pid"]: w["gpu"] for w in pool.workers()}
        results = pool.evaluate_many(jobs)
    poller.stop.set()
    poller.join()
    uuid_of = {d["index"]: d["uuid"] for d in devices}
    lines = [f"GPUs: {', '.join(d['index'] + ' ' + d['name'] + ' ' + d['uuid'] for d in devices)}; workers: {worker_gpu}", ""]
    by_device: dict[str, list[Any]] = {}
    for r in results:
        by_device.setdefault(r.device_id.split()[0], []).append(r)
    used = sorted(by_device)
    expected = sorted(uuid_of.values())
    ok = used == expected and all(r.status == "pass" for r in results)
    lines.append(f"- devices seen from inside the children: {used} (expected every GPU: {expected}) -> {'ok' if used == expected else 'FAIL'}")
    overlaps = 0
    for device, rows in by_device.items():
        spans = sorted(s for r in rows for s in r.timed_spans)
        overlaps += sum(1 for a, b in zip(spans, spans[1:]) if b[0] < a[1])
    ok &= overlaps == 0
    lines.append(f"- timed regions overlapping on one GPU: {overlaps} -> {'ok' if overlaps == 0 else 'FAIL'}")
    lines.append(f"- GPUs where nvidia-smi saw evaluation processes: {sorted(poller.seen)}")
    if len(devices) > 1:
        worst = 1.0
        for p in legit:
            speedups = {}
            for r, (_, cand) in zip(results, jobs):
                if cand.startswith(p["candidate_src"]) and r.speedup_eager:
                    speedups.setdefault(r.device_id.split()[0], []).append(r.speedup_eager)
            medians = [sorted(v)[len(v) // 2] for v in speedups.values()]
            if len(medians) > 1:
                worst = max(worst, max(medians) / min(medians))
        ok &= worst <= 1.03
        lines.append(f"- worst cross-GPU speedup ratio of one kernel: {worst:.3f} (limit 1.03)")
    else:
        lines.append("- one GPU only: cross-GPU agreement needs a machine with two (not lent to this session)")
    lines.append("- statuses: " + ", ".join(sorted({r.status for r in results})))
    return lines, ok


PLANTER = (ROOT / "tests" / "fixtures" / "gym" / "cache_planter.py").read_text()


def caches_check(perf_trials: int, work: Path) -> tuple[list[str], bool]:
    """Cold and warm cost of the cache layout (full protocol, torch.compile baseline, no reuse
    of the reference), and the planted-artifact attack against the compile baseline."""
    from kpipe.gym import Protocol
    from kpipe.gym.pool import GymPool

    protocol = Protocol(baseline="both", correct_trials=5, perf_trials=perf_trials, timeout_s=300, reject_findings=())
    legit = {p["key"]: p for p in bank_pairs(None) if p["key"].endswith("/legit")}
    tasks = [k for k in ("L1_19/legit", "L1_88/legit", "L2_76/legit") if k in legit]
    lines = ["| task | run | status | wall s | eager ms | compile ms | speedup compile |", "|---|---|---|---|---|---|---|"]
    ok = True
    with GymPool(protocol, workers=1, progress=False) as pool:
        for key in tasks:
            for run in range(3):
                r = pool.evaluate(legit[key]["reference_src"], legit[key]["candidate_src"] + f"\n# run {run}\n")
                label = "cold (new worker cache)" if run == 0 else "warm"
                lines.append(f"| {key} | {label} | {r.status} | {r.wall_s:.1f} | {r.eager_ms or 0:.3f} | {r.compile_ms or 0:.3f} | {r.speedup_compile or 0:.2f} |")
                ok &= r.status == "pass"
        pair = legit[tasks[0]]
        before = pool.evaluate(pair["reference_src"], pair["candidate_src"] + "\n# before\n")
        report = work / "planted"
        planted = pool.evaluate(pair["reference_src"], PLANTER.replace("REPORT_PATH", repr(str(report))) + pair["candidate_src"])
        after = pool.evaluate(pair["reference_src"], pair["candidate_src"] + "\n# after\n")
        other_key = tasks[-1]
        other = pool.evaluate(legit[other_key]["reference_src"], legit[other_key]["candidate_src"] + "\n# after the plant\n")
    files = report.read_text() if report.exists() else "0"
    ratio = (after.compile_ms or float("inf")) / (before.compile_ms or float("nan"))
    attack_ok = after.status == "pass" and other.status == "pass" and after.compile_ms is not None and 0.9 < ratio < 1.1
    ok &= attack_ok
    lines += ["", f"Planted artifacts: the planter ({planted.status}) rewrote {files} compiled modules it found; afterwards "
              f"{tasks[0]} compile baseline {before.compile_ms or 0:.3f} -> {after.compile_ms or 0:.3f} ms (ratio {ratio:.3f}), "
              f"status {after.status}; {other_key} {other.status} -> {'ok' if attack_ok else 'FAIL'}"]
    return lines, ok


def save(stem: str, text: str, rows: Any) -> None:
    """Write the report so far under $OUT (a later section that runs out of time loses nothing)."""
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"{stem}.md").write_text(text)
        Path(os.environ["OUT"], f"{stem}.json").write_text(json.dumps(rows, default=str)[:15_000_000])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="pool,service,placement,caches")
    parser.add_argument("--perf-trials", type=int, default=20)
    parser.add_argument("--limit", type=int, default=None, help="first N bank pairs only (a quick try)")
    parser.add_argument("--stride", type=int, default=1, help="every K-th bank pair only (fits a 10-minute call)")
    parser.add_argument("--size-cap", type=int, default=None, help="shrink the problems (a CPU smoke test of the script)")
    args = parser.parse_args()
    global SIZE_CAP
    SIZE_CAP = args.size_cap
    sections = args.sections.split(",")
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    fresh = cold_start()
    work = Path(tempfile.mkdtemp(prefix="gym-paths-"))
    devices = gpus()
    report = [f"# KernelGym paths from a cold start — {time.strftime('%Y-%m-%d')}, {', '.join(d['name'] for d in devices)} x{len(devices)}", "",
              f"Empty caches at start: {fresh}; perf trials {args.perf_trials}, 5 correctness trials, eager baseline, full KernelBench main sizes.", ""]
    everything_ok = True
    pairs = bank_pairs(args.limit)[:: args.stride]
    by_path: dict[str, list[dict[str, Any]]] = {}
    runners = {"pool": run_pool, "service": run_service, "eval": run_eval}
    checks = {"placement": placement_check, "caches": caches_check}
    for name in sections:  # in the order given: each section's report is saved as it ends
        if name in checks:
            lines, ok = checks[name](args.perf_trials, work)
            everything_ok &= ok
            report += ["", f"## {name}", "", *lines]
            save(f"gym_paths_{name}", "\n".join(report) + "\n", lines)
            continue
        rows, seconds = runners[name](pairs, args.perf_trials, work)
        by_path[name] = rows
        walls = [r.get("wall_s") or 0.0 for r in rows]
        report.append(f"- {name}: {len(rows)} evaluations in {seconds:.0f} s (first evaluation {walls[0]:.1f} s cold; median {sorted(walls)[len(walls) // 2]:.1f} s)")
        print(report[-1], flush=True)
        lines, _ = status_table(pairs, {name: rows})
        save(f"gym_paths_{name}", "\n".join(report + ["", *lines]) + "\n", rows)
    if by_path:
        lines, ok = status_table(pairs, by_path)
        everything_ok &= ok
        report += ["", "## Statuses per path", "", *lines, "", f"All paths agree with the bank's expected full-size statuses: {'yes' if ok else 'NO'}"]
    text = "\n".join(report) + "\n"
    print(text, flush=True)
    save("gym_paths_" + "-".join(sections), text, by_path)
    shutil.rmtree(work, ignore_errors=True)
    sys.exit(0 if everything_ok else 1)


if __name__ == "__main__":
    main()
