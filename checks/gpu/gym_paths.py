"""KernelGym from a cold start on a GPU machine, through every path users take (issue 13).

Every path must give each bank pair (legit and every variant, full KernelBench ``main`` sizes) the
bank's expected full-size status, so all paths agree per pair. Sections:

- ``pool``: the pairs through ``kpipe gym eval-batch`` (the pool: what distillation, RL and evaluation
  use); with confinement on by default, this is also the confined bank check (issue 25);
- ``service``: the same pairs through ``kpipe gym serve`` and the HTTP client;
- ``ray``: the same pairs through the Ray backend (``kpipe.gym.serve.distributed.RayGym``) on a local
  Ray instance this check starts, one actor per visible GPU;
- ``eval0``, ``eval1``, ``eval2``: a third of the pairs each (pairs K, K+3, ...) through the
  fresh-interpreter path of ``kpipe gym eval`` (``evaluate()`` in this process, the report saved after
  every pair; ``eval0`` also runs the CLI itself on three pairs);
- ``placement``: one pool worker per visible GPU, then the Ray backend with one actor per GPU:
  every child of worker (actor) k ran on worker k's GPU (the child's device UUID, and its process
  ancestry, recorded from inside it), all GPUs were used, no two timed regions overlapped on one
  GPU, and the same kernel's speedup agrees across GPUs within 3 %;
- ``caches``: the cost of the compile-cache layout, cold (first evaluation of a task in a new
  worker) and warm (the next ones), and a candidate that plants junk and slowed "compiled" code in
  every cache it can find: the compile baseline and a legit evaluation afterwards are unchanged.

``--limit N`` and ``--stride K`` narrow the bank (first N pairs, then every K-th); ``--pairs KEYS``
then keeps only the listed pairs (``L1_19/legit,L1_47/wrong_dtype``), in bank order; a key the bank
does not have, or one that ``--limit``/``--stride`` left out, is an error that names it.

``python -m checks.gpu.gym_paths DIR ...`` makes one status table from the reports (``gym_paths_*.json``)
in earlier runs' folders, one column per path (shards of one path fill one column; a section that did
not finish counts by the pairs it did). Per column, a folder later on the command line supersedes the
earlier folders' rows for the pairs it ran, so a full run followed by a rerun of a few pairs shows the
rerun's status for those and the full run's for the rest; exit status 1 unless every merged status is
the expected one.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from checks.gpu.harness import CheckFailed, Report, Section

ROOT = Path(__file__).resolve().parents[2]
TITLE = "KernelGym paths from a cold start"
CLI = [sys.executable, "-c", "from kpipe.cli import main; main()"]
EVAL_SHARDS = 3  # the fresh-interpreter path evaluates one pair per interpreter: a third of the bank per section


def gpus() -> list[dict[str, str]]:
    """The GPUs this process may use (nvidia-smi's, narrowed by CUDA_VISIBLE_DEVICES)."""
    if not shutil.which("nvidia-smi"):
        return []
    out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,pci.bus_id,name", "--format=csv,noheader"],
                         capture_output=True, text=True, check=True).stdout
    every = [dict(zip(("index", "uuid", "pci", "name"), (c.strip() for c in line.split(",")))) for line in out.strip().splitlines()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return every
    wanted = [v.strip() for v in visible.split(",") if v.strip() and v.strip() != "-1"]
    return [d for w in wanted for d in every if w in (d["index"], d["uuid"])]


class GpuPoller(threading.Thread):
    """Polls nvidia-smi: which process ran on which GPU (by UUID)."""

    def __init__(self, interval_s: float = 0.3) -> None:
        super().__init__(daemon=True)
        self.interval_s = interval_s
        self.seen: dict[str, set[int]] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        if not shutil.which("nvidia-smi"):
            return
        while not self.stop.is_set():
            out = subprocess.run(["nvidia-smi", "--query-compute-apps=gpu_uuid,pid", "--format=csv,noheader"],
                                 capture_output=True, text=True).stdout
            for line in out.strip().splitlines():
                if "," in line:
                    uuid, pid = (c.strip() for c in line.split(",", 1))
                    self.seen.setdefault(uuid, set()).add(int(pid))
            self.stop.wait(self.interval_s)


def bank_pairs(size_cap: int | None = None) -> list[dict[str, Any]]:
    """Every bank pair with its expected status: the full-size one, or the small one under `size_cap`."""
    from kpipe.data.kernelbench import select_problems, shrink_sizes
    from kpipe.gym.bank import list_solutions

    references = {(p.level, p.problem_id): shrink_sizes(p.code, size_cap) if size_cap else p.code for p in select_problems("main", [1, 2])}
    return [
        {"key": s.key, "reference_src": references[(s.level, s.problem_id)], "candidate_src": s.source,
         "expected": s.expected_status if size_cap else s.expected_status_full}
        for s in list_solutions()
    ]


def select_pairs(every: list[dict[str, Any]], limit: int | None, stride: int, keys: str | None) -> list[dict[str, Any]]:
    """The bank pairs a run uses: the first `limit`, every `stride`-th of those, then only the
    pairs named in `keys` (comma-separated, as the rows' ``pair`` field: ``L1_19/legit``), in bank
    order. ValueError naming any key the bank lacks or the limit/stride left out."""
    chosen = (every[:limit] if limit else every)[::stride]
    if keys is None:
        return chosen
    wanted = list(dict.fromkeys(k.strip() for k in keys.split(",") if k.strip()))
    if not wanted:
        raise ValueError("--pairs names no pair")
    known = {p["key"] for p in every}
    unknown = [k for k in wanted if k not in known]
    if unknown:
        raise ValueError(f"--pairs: unknown pair key(s) {', '.join(unknown)} (keys look like "
                         f"{', '.join(p['key'] for p in every[:2])}; the bank has {len(known)})")
    kept = {p["key"] for p in chosen}
    dropped = [k for k in wanted if k not in kept]
    if dropped:
        raise ValueError(f"--pairs: pair key(s) {', '.join(dropped)} are in the bank but not in the selection "
                         f"--limit/--stride leave ({len(chosen)} pairs)")
    return [p for p in chosen if p["key"] in set(wanted)]


def protocol_args(perf_trials: int, baseline: str = "eager") -> list[str]:
    return ["--baseline", baseline, "--correct-trials", "5", "--perf-trials", str(perf_trials), "--timeout", "180"]


def eager_protocol(perf_trials: int) -> Any:
    from kpipe.gym import Protocol

    return Protocol(baseline="eager", correct_trials=5, perf_trials=perf_trials, timeout_s=180)


def as_row(result: Any) -> dict[str, Any]:
    return result.to_row() if hasattr(result, "to_row") else dict(result)


def run_pool(pairs: list[dict[str, Any]], perf_trials: int, work: Path, report: Report) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    batch = work / "pairs.parquet"
    pq.write_table(pa.table({"reference_src": [p["reference_src"] for p in pairs], "candidate_src": [p["candidate_src"] for p in pairs]}), batch)
    output = work / "results.parquet"
    subprocess.run([*CLI, "gym", "eval-batch", "--input", str(batch), "--output", str(output), "--cache", str(work / "cache.sqlite"),
                    "--reuse-reference", *protocol_args(perf_trials)], check=True)
    return pq.read_table(output).to_pylist(), {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_service(pairs: list[dict[str, Any]], perf_trials: int, work: Path, report: Report) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from kpipe.gym.serve.client import GymClient

    port = free_port()
    started = time.monotonic()
    server = subprocess.Popen([*CLI, "gym", "serve", "--port", str(port), "--cache", str(work / "cache.sqlite"),
                               "--reuse-reference", *protocol_args(perf_trials)])
    try:
        client = GymClient(f"http://127.0.0.1:{port}")
        for _ in range(600):
            try:
                client.health()
                break
            except Exception:  # noqa: BLE001 - not up yet
                if server.poll() is not None:
                    raise RuntimeError(f"kpipe gym serve exited with {server.returncode}") from None
                time.sleep(0.5)
        up_s = time.monotonic() - started
        results = client.evaluate_many([(p["reference_src"], p["candidate_src"]) for p in pairs])
        client.close()
        return [as_row(r) for r in results], {"start_s": round(up_s, 1)}
    finally:
        server.terminate()
        server.wait(timeout=60)


def start_ray() -> tuple[Any, float]:
    """A local Ray instance of its own (never one a `ray start` left running), no dashboard."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    started = time.monotonic()
    ray.init(address="local", include_dashboard=False, log_to_driver=False, object_store_memory=2 * 1024**3,
             _node_ip_address="127.0.0.1")
    return ray, time.monotonic() - started


def run_ray(pairs: list[dict[str, Any]], perf_trials: int, work: Path, report: Report) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from kpipe.gym.serve.distributed import RayGym

    ray, init_s = start_ray()
    try:
        started = time.monotonic()
        with RayGym(eager_protocol(perf_trials), reuse_reference=True, progress=False) as gym:
            up_s = time.monotonic() - started
            actors = gym.workers()
            results = gym.evaluate_many([(p["reference_src"], p["candidate_src"]) for p in pairs])
        return [as_row(r) for r in results], {"ray_init_s": round(init_s, 1), "actors_start_s": round(up_s, 1),
                                              "cluster": ray.cluster_resources(), "actors": actors}
    finally:
        ray.shutdown()


def run_eval(pairs: list[dict[str, Any]], perf_trials: int, work: Path, report: Report, cli_pairs: int = 3) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The fresh-interpreter path of ``kpipe gym eval``: in this process for every pair (one
    reference run per task, as --reuse-reference does), and the CLI itself on `cli_pairs` pairs.
    The rows so far are saved after every pair (a call that runs out of time keeps them)."""
    from kpipe.gym import evaluate

    protocol = eager_protocol(perf_trials)
    rows: list[dict[str, Any]] = []
    for pair in pairs:
        try:
            rows.append(evaluate(pair["reference_src"], pair["candidate_src"], protocol, reuse_reference=True).to_row())
        except Exception as exc:  # noqa: BLE001 - a reference failure is a row too
            rows.append({"status": "reference_error", "diagnostic": str(exc)})
        rows[-1]["pair"] = pair["key"]
        report.data.update(path="eval", column="eval", rows=rows)
        report.save()
    for pair, row in list(zip(pairs, rows))[:: max(1, len(pairs) // 3)][:cli_pairs]:
        ref, cand = work / "reference.py", work / "candidate.py"
        ref.write_text(pair["reference_src"])
        cand.write_text(pair["candidate_src"])
        out = subprocess.run([*CLI, "gym", "eval", "--reference", str(ref), "--candidate", str(cand), "--json", *protocol_args(perf_trials)],
                             capture_output=True, text=True)
        cli_status = json.loads(out.stdout.strip().splitlines()[-1])["status"] if out.returncode == 0 else f"exit {out.returncode}"
        row["cli_status"] = cli_status
    return rows, {"cli_pairs": min(cli_pairs, len(rows))}



def why_not(row: dict[str, Any]) -> str:
    """A row's reason for its status: the diagnostic, or a hacked row's reasons (it has no diagnostic)."""
    reasons = row.get("hack_reasons")
    if reasons is not None and len(reasons) and not row.get("diagnostic"):
        return "; ".join(str(reason) for reason in reasons)
    return str(row.get("diagnostic", ""))

def status_table(pairs: list[dict[str, Any]], by_path: dict[str, dict[str, dict[str, Any]]]) -> tuple[list[str], bool, dict[str, int]]:
    """One row per pair, one column per path (rows keyed by pair); a path that did not run a
    pair shows "—" and is not counted against it. Returns the lines, whether every status run
    is the expected one, and how many pairs each path ran."""
    paths = list(by_path)
    lines = ["| pair | expected | " + " | ".join(paths) + " | agree |", "|---|---|" + "---|" * (len(paths) + 1)]
    ok = True
    for pair in pairs:
        rows = {p: by_path[p][pair["key"]] for p in paths if pair["key"] in by_path[p]}
        if not rows:
            continue
        statuses = [r.get("status", "?") for r in rows.values()]
        cli = [r["cli_status"] for r in rows.values() if r.get("cli_status")]
        agree = all(s == pair["expected"] for s in statuses + cli)
        ok &= agree
        cells = []
        for p in paths:
            row = rows.get(p)
            if row is None:
                cells.append("—")
                continue
            s = row.get("status", "?")
            cells.append(s + ("" if s == pair["expected"] else f" ({why_not(row)[:160]})"))
        lines.append(f"| {pair['key']} | {pair['expected']} | " + " | ".join(c.replace("|", "/").replace("\n", " ") for c in cells)
                     + f" | {'yes' if agree else 'NO'}{' (CLI: ' + cli[0] + ')' if cli else ''} |")
    return lines, ok, {p: len(by_path[p]) for p in paths}


# Appended to a candidate in the placement check: the child that imports it records its own
# process ancestry, so each result can be tied to the pool worker (Ray actor) that ran it.
# Reading /proc and writing a file are `file_io` findings, which inform and do not reject.
PROBE = '''
import os as _probe_os
_probe_pids, _probe_pid = [], _probe_os.getpid()
while _probe_pid > 1 and len(_probe_pids) < 32:
    _probe_pids.append(_probe_pid)
    with open(f"/proc/{_probe_pid}/stat") as _probe_f:
        _probe_pid = int(_probe_f.read().rsplit(")", 1)[1].split()[1])
with open(PROBE_PATH, "a") as _probe_f:
    _probe_f.write(f"{JOB_TAG!r} {_probe_pids}\\n")
'''


def placement_run(kind: str, devices: list[dict[str, str]], jobs: list[tuple[str, str]], perf_trials: int) -> tuple[list[Any], list[dict[str, Any]], dict[str, set[int]], float]:
    """Run the placement jobs on the pool's workers (one Ray actor per GPU); the results, the
    workers (pid -> GPU), the processes nvidia-smi saw per GPU, and the wall time.

    Unconfined (``KPIPE_GYM_UNCONFINED``, for this section only): the probe ties a child to its
    worker through ``/proc`` ancestry and a file outside its scratch, which a confined candidate can
    neither see (its own PID namespace) nor write (Landlock). Confinement has its own check
    (``python -m checks.gpu confinement``)."""
    from unittest import mock

    from kpipe.gym.confine.sandbox import OPT_OUT_VARIABLE

    with mock.patch.dict(os.environ, {OPT_OUT_VARIABLE: "1"}):  # the environment as it was, after
        return placement_pass(kind, devices, jobs, perf_trials)


def placement_pass(kind: str, devices: list[dict[str, str]], jobs: list[tuple[str, str]], perf_trials: int) -> tuple[list[Any], list[dict[str, Any]], dict[str, set[int]], float]:
    from kpipe.gym.serve.pool import GymPool

    poller = GpuPoller()
    poller.start()
    started = time.monotonic()
    protocol = eager_protocol(perf_trials)
    if kind == "pool":
        with GymPool(protocol, progress=False) as pool:
            results = pool.evaluate_many(jobs)
            workers = [{"slot": w["slot"], "pid": w["pid"], "gpu": w["gpu"], "done": w["done"], "restarts": w["restarts"]} for w in pool.workers()]
    else:
        from kpipe.gym.serve.distributed import RayGym

        ray, _ = start_ray()
        try:
            with RayGym(protocol, actors=max(1, len(devices)) if devices else 2, progress=False) as gym:
                results = gym.evaluate_many(jobs)
                workers = [{"slot": w["slot"], "pid": w["pid"], "gpu": w.get("gpu"), "done": w.get("done"), "restarts": w.get("restarts")}
                           for w in gym.workers()]
        finally:
            ray.shutdown()
    poller.stop.set()
    poller.join()
    return results, workers, poller.seen, time.monotonic() - started


def placement_verdict(kind: str, devices: list[dict[str, str]], legit: list[dict[str, Any]], tags: list[str], results: list[Any],
                      workers: list[dict[str, Any]], seen: dict[str, set[int]], probe_path: Path) -> tuple[list[str], bool]:
    uuid_of = {d["index"]: d["uuid"] for d in devices}
    ancestry: dict[str, set[int]] = {}
    if probe_path.exists():
        for line in probe_path.read_text().splitlines():
            tag, pids = line.rsplit(" [", 1)  # "'L1_19/legit pool 0' [child, zygote, worker, ...]"
            ancestry.setdefault(ast.literal_eval(tag), set()).update(json.loads("[" + pids))
    lines = [f"Workers ({kind}): " + "; ".join(f"{w['slot']}: pid {w['pid']} GPU {w['gpu']} ({w['done']} done, {w['restarts']} restarts)" for w in workers)]
    ok = all(getattr(r, "status", None) == "pass" for r in results)
    expected = sorted(uuid_of.values()) if devices else ["cpu"]
    by_device: dict[str, list[Any]] = {}
    by_timer: dict[str, list[Any]] = {}  # one GPU; without GPUs, one worker's CPU slot
    misplaced = unmatched = 0
    for tag, r in zip(tags, results):
        device = getattr(r, "device_id", "?").split()[0] if getattr(r, "device_id", "") else "?"
        by_device.setdefault(device, []).append(r)
        owners = [w for w in workers if w["pid"] in ancestry.get(tag, set())]
        by_timer.setdefault(device if devices else f"{device} worker {owners[0]['slot'] if owners else '?'}", []).append(r)
        if len(owners) != 1:
            unmatched += 1
            continue
        want = uuid_of.get(str(owners[0]["gpu"]), "cpu") if devices else "cpu"
        misplaced += device != want
    used = sorted(by_device)
    ok &= used == expected and misplaced == 0 and unmatched == 0
    lines.append(f"- children tied to their worker by process ancestry: {len(results) - unmatched}/{len(results)}; "
                 f"a child on another GPU than its worker's: {misplaced} -> {'ok' if misplaced == 0 and unmatched == 0 else 'FAIL'}")
    lines.append(f"- devices seen from inside the children: {used} (expected every GPU: {expected}) -> {'ok' if used == expected else 'FAIL'}")
    overlaps = 0
    for rows in by_timer.values():
        spans = sorted(s for r in rows for s in r.timed_spans)
        overlaps += sum(1 for a, b in zip(spans, spans[1:]) if b[0] < a[1])
    ok &= overlaps == 0
    lines.append(f"- timed regions overlapping on one {'GPU' if devices else 'worker (CPU run)'}: {overlaps} -> {'ok' if overlaps == 0 else 'FAIL'}")
    lines.append(f"- GPUs where nvidia-smi saw evaluation processes: {sorted(seen)}")
    if len(devices) > 1:
        worst = 1.0
        for p in legit:
            speedups: dict[str, list[float]] = {}
            for r, tag in zip(results, tags):
                if tag.startswith(p["key"] + " ") and getattr(r, "speedup_eager", None):
                    speedups.setdefault(r.device_id.split()[0], []).append(r.speedup_eager)
            medians = [sorted(v)[len(v) // 2] for v in speedups.values()]
            if len(medians) > 1:
                worst = max(worst, max(medians) / min(medians))
        ok &= worst <= 1.03
        lines.append(f"- worst cross-GPU speedup ratio of one kernel: {worst:.3f} (limit 1.03)")
    else:
        lines.append("- one GPU only: cross-GPU agreement needs a machine with two")
    lines.append("- statuses: " + ", ".join(sorted({getattr(r, "status", None) or r["status"] for r in results})))
    return lines, ok


def placement_check(perf_trials: int, work: Path, size_cap: int | None, limit: int | None) -> tuple[list[str], bool, dict[str, Any]]:
    """One worker per GPU over a batch of legit kernels (each 2x per GPU), first on the pool,
    then on the Ray backend (one actor per GPU): placement, overlap, agreement."""
    devices = gpus()
    legit = [p for p in bank_pairs(size_cap) if p["key"].endswith("/legit")][: min(6, limit or 6)]
    lines = [f"GPUs: {', '.join(d['index'] + ' ' + d['name'] + ' ' + d['uuid'] for d in devices) or 'none (CPU)'}", ""]
    ok = True
    extra: dict[str, Any] = {}
    for kind in ("pool", "ray"):
        probe_path = work / f"probe-{kind}.txt"
        tags = [f"{p['key']} {kind} {k}" for p in legit for k in range(2 * max(1, len(devices)))]
        by_key = {p["key"]: p for p in legit}
        jobs = [(by_key[t.split()[0]]["reference_src"],
                 by_key[t.split()[0]]["candidate_src"] + PROBE.replace("PROBE_PATH", repr(str(probe_path))).replace("JOB_TAG", repr(t)))
                for t in tags]
        try:
            results, workers, seen, wall = placement_run(kind, devices, jobs, perf_trials)
            verdict, kind_ok = placement_verdict(kind, devices, legit, tags, results, workers, seen, probe_path)
        except Exception as exc:  # noqa: BLE001 - the other backend still runs
            lines += [f"### {kind}", "", f"- FAIL: {type(exc).__name__}: {exc}", ""]
            ok = False
            continue
        ok &= kind_ok
        lines += [f"### {kind} ({len(jobs)} evaluations, {wall:.0f} s)", "", *verdict, ""]
        extra[kind] = {"wall_s": round(wall, 1), "workers": workers, "ok": kind_ok,
                       "rows": [dict(as_row(r), pair=t) for r, t in zip(results, tags)]}
    return lines, ok, extra


PLANTER = (ROOT / "tests" / "fixtures" / "gym" / "cache_planter.py").read_text()


def caches_check(perf_trials: int, work: Path, size_cap: int | None) -> tuple[list[str], bool, dict[str, Any]]:
    """Cold and warm cost of the cache layout (full protocol, torch.compile baseline, no reuse
    of the reference), and the planted-artifact attack against the compile baseline."""
    from kpipe.gym import Protocol
    from kpipe.gym.serve.pool import GymPool

    protocol = Protocol(baseline="both", correct_trials=5, perf_trials=perf_trials, timeout_s=300, reject_findings=())
    legit = {p["key"]: p for p in bank_pairs(size_cap) if p["key"].endswith("/legit")}
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
    return lines, ok, {}


def add_options(parser: argparse._ArgumentGroup) -> None:
    parser.add_argument("--perf-trials", type=int, default=20)
    parser.add_argument("--limit", type=int, default=None, help="first N bank pairs only (a quick try)")
    parser.add_argument("--stride", type=int, default=1, help="every K-th bank pair only (a quick try)")
    parser.add_argument("--pairs", default=None, metavar="KEYS",
                        help="only these pairs (after --limit/--stride): comma-separated keys as in the rows' "
                             "'pair' field, e.g. L1_19/legit,L1_47/wrong_dtype")
    parser.add_argument("--size-cap", type=int, default=None, help="shrink the problems (a CPU smoke test)")


def chosen_pairs(options: argparse.Namespace) -> list[dict[str, Any]]:
    try:
        return select_pairs(bank_pairs(options.size_cap), options.limit, options.stride, options.pairs)
    except ValueError as exc:
        raise CheckFailed(str(exc)) from None


RUNNERS = {"pool": run_pool, "service": run_service, "ray": run_ray, "eval": run_eval}


def path_section(path: str, shard: int | None = None) -> Callable[[Report, argparse.Namespace], None]:
    """A section running the chosen pairs (shard `shard` of EVAL_SHARDS, if given) through `path`:
    every pair must get the bank's expected status."""
    def run(report: Report, options: argparse.Namespace) -> None:
        pairs = chosen_pairs(options)
        pairs = pairs if shard is None else pairs[shard::EVAL_SHARDS]
        runner = RUNNERS[path] if shard in (None, 0) else functools.partial(run_eval, cli_pairs=0)  # the CLI on shard 0
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f"gym-paths-{path}-") as work:
            rows, info = runner(pairs, options.perf_trials, Path(work), report)
        wall = time.monotonic() - started
        for pair, row in zip(pairs, rows):
            row["pair"] = pair["key"]
        walls = [float(r.get("wall_s") or 0.0) for r in rows]
        warm = sorted(walls[1:])
        figures = {"pairs": len(rows), "wall_s": round(wall, 1), "first_eval_s": round(walls[0], 1) if walls else None,
                   "median_warm_eval_s": round(warm[len(warm) // 2], 1) if warm else None,
                   "devices": sorted({str(r.get("device_id", "")).split(" ")[0] for r in rows if r.get("device_id")}), **info}
        lines, ok, _ = status_table(pairs, {path: {r["pair"]: r for r in rows}})
        report.data.update(path=path, column=path, ok=ok, rows=rows, **figures)
        report.line(f"{len(rows)} evaluations in {wall:.0f} s (first {figures['first_eval_s']} s cold; warm median "
                    f"{figures['median_warm_eval_s']} s), {'sizes capped at ' + str(options.size_cap) if options.size_cap else 'full KernelBench main sizes'}, "
                    f"{options.perf_trials} perf trials, 5 correctness trials, eager baseline.", "", *lines)
        report.expect(ok, "pairs without their expected status (table above)")
    run.__doc__ = f"Every chosen pair{'' if shard is None else f' of shard {shard}'} gets its expected status through {path}."
    return run


def placement(report: Report, options: argparse.Namespace) -> None:
    """Each worker's (actor's) children on its GPU, every GPU used, no overlapping timed regions."""
    with tempfile.TemporaryDirectory(prefix="gym-paths-placement-") as work:
        lines, ok, extra = placement_check(options.perf_trials, Path(work), options.size_cap, options.limit)
    report.line(*lines)
    report.data.update(check="placement", ok=ok, **extra)
    report.expect(ok, "placement (lines marked FAIL above)")


def caches(report: Report, options: argparse.Namespace) -> None:
    """Cold and warm cost of the compile caches; planted cache junk changes nothing."""
    with tempfile.TemporaryDirectory(prefix="gym-paths-caches-") as work:
        lines, ok, extra = caches_check(options.perf_trials, Path(work), options.size_cap)
    report.line(*lines)
    report.data.update(check="caches", ok=ok, **extra)
    report.expect(ok, "compile caches (table above)")


SECTIONS = (Section("pool", 240, path_section("pool")), Section("service", 280, path_section("service")),
            Section("ray", 380, path_section("ray")),
            *(Section(f"eval{k}", 450, path_section("eval", k)) for k in range(EVAL_SHARDS)),
            Section("placement", 150, placement), Section("caches", 150, caches))


def rows_per_path(sections: dict[str, Any], origin: dict[str, int]) -> tuple[dict[str, dict[str, dict[str, Any]]], dict[str, dict[str, int]], dict[str, int]]:
    """The status-table columns: per column (path, or repeated run), the row of each pair, and
    the index of the folder it came from. `origin` gives each section's folder index (its place
    on the --merge command line; 0 for every section of one run). A row from a later folder
    supersedes an earlier folder's row of that pair in that column; within one folder the later
    section wins (as it always did). Also returns, per section, how many of its rows a later
    folder superseded."""
    by_path: dict[str, dict[str, dict[str, Any]]] = {}
    source: dict[str, dict[str, int]] = {}
    owner: dict[str, dict[str, str]] = {}
    for label, done in sections.items():
        if "check" in done:
            continue
        column, rank = done.get("column") or done["path"], origin.get(label, 0)
        rows, came, who = by_path.setdefault(column, {}), source.setdefault(column, {}), owner.setdefault(column, {})
        for row in done["rows"]:
            if row["pair"] in came and came[row["pair"]] > rank:  # a later folder's row stays
                continue
            rows[row["pair"]], came[row["pair"]], who[row["pair"]] = row, rank, label
    superseded = {label: 0 for label in sections}
    for label, done in sections.items():
        if "check" not in done:
            column, rank = done.get("column") or done["path"], origin.get(label, 0)
            superseded[label] = sum(1 for r in done["rows"] if source[column][r["pair"]] > rank)
    return by_path, source, superseded


def combined_report(pairs: list[dict[str, Any]], sections: dict[str, Any], origin: dict[str, int],
                    folders: list[str]) -> tuple[list[str], bool]:
    """Per-section figures, then one status table over every path that ran (shards of one path
    merged). With `origin` (section -> index into `folders`), a later folder's rows supersede an
    earlier one's per pair and column (`rows_per_path`), and the report says per column which folder
    each row came from."""
    by_path, source, superseded = rows_per_path(sections, origin)
    lines = ["| section | pairs | wall s | first eval s (cold) | warm median s | expected statuses |",
             "|---|---|---|---|---|---|"]
    ok = True
    for label, done in sections.items():
        if not superseded.get(label):  # a section a later folder reran in part is judged by the merged table
            ok &= bool(done.get("ok"))
        if "check" in done:
            lines.append(f"| {label} | — | {done.get('wall_s')} | — | — | {'ok' if done['ok'] else 'FAIL'} |")
            continue
        note = f" ({superseded[label]} superseded by a later folder)" if superseded.get(label) else ""
        lines.append(f"| {label} | {len(done['rows'])}{note} | {done.get('wall_s')} | {done.get('first_eval_s')} | "
                     f"{done.get('median_warm_eval_s')} | {'all' if done['ok'] else 'NOT all'} |")
    if by_path:
        table, agree, counts = status_table(pairs, by_path)
        ok &= agree
        lines += ["", "## Statuses per path", "", "Pairs run: " + ", ".join(f"{p} {n}/{len(pairs)}" for p, n in counts.items()), ""]
        if len(folders) > 1:
            lines += ["Rows per path by folder (a later folder on the command line supersedes an earlier one's row of the same pair):", ""]
            for column, came in source.items():
                per = [sum(1 for rank in came.values() if rank == i) for i in range(len(folders))]
                lines.append(f"- {column}: " + ", ".join(f"{n} pairs from {folders[i]}" for i, n in enumerate(per) if n))
            lines.append("")
        lines += [*table, "", f"Every status run is the bank's expected one (so all paths agree per pair): {'yes' if agree else 'NO'}"]
    return lines, ok


def merge(dirs: list[Path], pairs: list[dict[str, Any]]) -> tuple[list[str], bool]:
    """The combined status table from the gym_paths reports of earlier runs; a section that did not
    finish counts by the pairs it did; per path, a later folder's rows supersede an earlier folder's
    for the pairs it ran."""
    sections: dict[str, Any] = {}
    origin: dict[str, int] = {}
    expected = {p["key"]: p["expected"] for p in pairs}
    for rank, folder in enumerate(dirs):
        for path in sorted(folder.glob("gym_paths*.json")):
            for name, section in json.loads(path.read_text())["sections"].items():
                data = section["data"]
                if "path" not in data and "check" not in data:
                    continue
                if not section["done"]:  # stopped at the call's limit: the pairs it finished
                    data = {**data, "ok": all(r.get("status") == expected.get(r.get("pair")) for r in data["rows"])}
                sections[f"{name} ({folder})"] = data
                origin[f"{name} ({folder})"] = rank
    return combined_report(pairs, sections, origin, [str(d) for d in dirs])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one status table from earlier gym_paths runs' report folders")
    parser.add_argument("folders", nargs="+", type=Path, help="later folders supersede earlier ones' rows per pair")
    parser.add_argument("--size-cap", type=int, default=None, help="the runs' --size-cap (their expected statuses)")
    args = parser.parse_args(argv)
    lines, ok = merge(args.folders, bank_pairs(args.size_cap))
    print("\n".join([f"# KernelGym paths, merged from {', '.join(str(d) for d in args.folders)}", "", *lines]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())


def figures(report: dict[str, Any]) -> dict[str, Any]:
    """The ledger's figures: the pairs each path ran, and the pool's first and warm evaluation seconds."""
    paths = {name: section["data"] for name, section in report["sections"].items() if "rows" in section["data"]}
    pool = paths.get("pool", {})
    return {**{f"{name}_pairs": len(data["rows"]) for name, data in paths.items()},
            **{name: pool[name] for name in ("first_eval_s", "median_warm_eval_s") if name in pool}}
