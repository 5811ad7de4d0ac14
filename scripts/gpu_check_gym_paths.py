#!/usr/bin/env python
"""KernelGym from a cold start on a GPU machine, through every path users take (issue 13).

    . scripts/device_env.sh && python scripts/gpu_check_gym_paths.py --sections pool,service,ray,eval,placement,caches
    . scripts/device_env.sh && python scripts/gpu_check_gym_paths.py --sections "pool,service+eval:0/2+eval:1/2"
    . scripts/device_env.sh && python scripts/gpu_check_gym_paths.py --sections "service,ray" --pairs L1_19/legit,L1_47/legit
    python scripts/gpu_check_gym_paths.py --merge OUT1 OUT2 ...   # one status table from earlier runs' outputs

Before anything runs, ``TRITON_CACHE_DIR`` and ``TORCHINDUCTOR_CACHE_DIR`` point at new empty
directories and ``~/.triton`` is moved aside, so nothing compiled by an earlier process helps.

Sections (each prints a Markdown table; the reports go to $OUT/gym_paths_*.md and the rows to
$OUT/gym_paths_*.json when $OUT is set, each as soon as its section ends):

- ``pool``: every bank solution (legit and every variant, full KernelBench ``main`` sizes)
  through ``kpipe gym eval-batch`` (the pool: what distillation, RL and evaluation use);
- ``service``: the same pairs through ``kpipe gym serve`` and the HTTP client;
- ``ray``: the same pairs through the Ray backend (``kpipe.gym.distributed.RayGym``) on a local
  Ray instance this script starts, one actor per visible GPU;
- ``eval``: the same pairs through the fresh-interpreter path of ``kpipe gym eval``
  (``evaluate()`` in this process, saved after every pair; plus the CLI itself on three pairs);
- ``placement``: one pool worker per visible GPU, then the Ray backend with one actor per GPU:
  for each, every child of worker (actor) k ran on worker k's GPU (the child's device UUID, and
  its process ancestry, recorded from inside it), all GPUs were used, no two timed regions
  overlapped on one GPU, and the same kernel's speedup agrees across GPUs within 3 %;
- ``caches``: the cost of the compile-cache layout, cold (first evaluation of a task in a new
  worker: torch.compile and Triton from nothing) and warm (the next ones), and a candidate that
  plants junk and slowed "compiled" code in every cache it can find: the compile baseline and a
  legit evaluation afterwards are unchanged.

``--sections`` is a list of lanes separated by ``+``, each a comma-separated list of sections run
in order. With one lane, everything runs in this process on every visible GPU. With several,
lane i runs in its own process pinned to GPU i (``CUDA_VISIBLE_DEVICES``, round robin when there
are more lanes than GPUs: their timings then share a GPU), with its own empty compile caches;
a lane sees one GPU, so ``placement`` belongs in a one-lane run. ``pool``, ``service``, ``ray`` and
``eval`` take a shard, ``eval:K/N`` (pairs K, K+N, ... of the selection), to spread one path over
lanes or calls. A section named twice in one lane runs twice: the second run (``pool#2``) is the
warm figure (compile caches filled by the first; a new result cache, so everything re-runs).

``--limit N`` and ``--stride K`` narrow the bank (first N pairs, then every K-th); ``--pairs KEYS``
then keeps only the listed pairs, comma-separated keys as in the rows' ``pair`` field
(``L1_19/legit,L1_47/wrong_dtype``), in bank order; a key the bank does not have, or one that
``--limit``/``--stride`` left out, is an error that names it. Lanes get the same selection.

``--merge DIR ...`` reads the ``gym_paths_*.json`` of earlier runs' $OUT folders (an eval section
that ran out of time counts by its ``.partial`` file, the pairs it finished) and makes one status
table, one column per path (``pool``, ``service``, ``ray``, ``eval``; a repeated run such as
``pool#2`` is its own column; shards of one path fill one column). Per column, a folder later on
the command line supersedes the earlier folders' rows for the pairs it ran; every other pair keeps
its row from the last folder that ran it. So a full run followed by a rerun of a few pairs
(``--merge FULL RERUN``) shows the rerun's status for those pairs and the full run's for the
rest, and the report says per column how many rows came from which folder. The verdict is the
merged table's: a section whose rows were superseded no longer fails the merge by itself.

Every path must give the bank's expected full-size status, and all paths the same status per
pair. Exit status 1 if any check fails. ``--dry-run`` prints the plan only.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import gpu_harness

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-c", "from kpipe.cli import main; main()"]
PATHS = ("pool", "service", "ray", "eval")  # the evaluation paths: one row per bank pair
CHECKS = ("placement", "caches")
SECTIONS = PATHS + CHECKS


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


SIZE_CAP: int | None = None  # --size-cap: a CPU smoke test of this script (the small-size statuses apply)
LIMIT: int | None = None  # --limit: also the number of tasks the placement check uses (at most 6)


def bank_pairs(limit: int | None) -> list[dict[str, Any]]:
    from kpipe.data.kernelbench import select_problems, shrink_sizes
    from kpipe.gym.bank import list_solutions

    references = {(p.level, p.problem_id): shrink_sizes(p.code, SIZE_CAP) if SIZE_CAP else p.code for p in select_problems("main", [1, 2])}
    pairs = [
        {"key": s.key, "reference_src": references[(s.level, s.problem_id)], "candidate_src": s.source,
         "expected": s.expected_status if SIZE_CAP else s.expected_status_full}
        for s in list_solutions()
    ]
    return pairs[:limit] if limit else pairs


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


def run_pool(pairs: list[dict[str, Any]], perf_trials: int, work: Path, tag: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    batch = work / f"pairs-{tag}.parquet"
    pq.write_table(pa.table({"reference_src": [p["reference_src"] for p in pairs], "candidate_src": [p["candidate_src"] for p in pairs]}), batch)
    output = work / f"{tag}.parquet"
    subprocess.run([*CLI, "gym", "eval-batch", "--input", str(batch), "--output", str(output), "--cache", str(work / f"{tag}-cache.sqlite"),
                    "--reuse-reference", *protocol_args(perf_trials)], check=True)
    return pq.read_table(output).to_pylist(), {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_service(pairs: list[dict[str, Any]], perf_trials: int, work: Path, tag: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from kpipe.gym.client import GymClient

    port = free_port()
    started = time.monotonic()
    server = subprocess.Popen([*CLI, "gym", "serve", "--port", str(port), "--cache", str(work / f"{tag}-cache.sqlite"),
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


def run_ray(pairs: list[dict[str, Any]], perf_trials: int, work: Path, tag: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from kpipe.gym.distributed import RayGym

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


def run_eval(pairs: list[dict[str, Any]], perf_trials: int, work: Path, tag: str, cli_pairs: int = 3) -> tuple[list[dict[str, Any]], dict[str, Any]]:
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
        gpu_harness.write_report(f"gym_paths_{tag}.partial", f"{len(rows)}/{len(pairs)} pairs\n", rows)
    for pair, row in list(zip(pairs, rows))[:: max(1, len(pairs) // 3)][:cli_pairs]:
        ref, cand = work / f"ref-{tag}.py", work / f"cand-{tag}.py"
        ref.write_text(pair["reference_src"])
        cand.write_text(pair["candidate_src"])
        out = subprocess.run([*CLI, "gym", "eval", "--reference", str(ref), "--candidate", str(cand), "--json", *protocol_args(perf_trials)],
                             capture_output=True, text=True)
        cli_status = json.loads(out.stdout.strip().splitlines()[-1])["status"] if out.returncode == 0 else f"exit {out.returncode}"
        row["cli_status"] = cli_status
    return rows, {"cli_pairs": min(cli_pairs, len(rows))}


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
            cells.append(s + ("" if s == pair["expected"] else f" ({str(row.get('diagnostic', ''))[:60]})"))
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
    """Run the placement jobs on one worker (actor) per GPU; the results, the workers
    (pid -> GPU), the processes nvidia-smi saw per GPU, and the wall time."""
    from kpipe.gym.pool import GymPool

    poller = GpuPoller()
    poller.start()
    started = time.monotonic()
    protocol = eager_protocol(perf_trials)
    if kind == "pool":
        with GymPool(protocol, progress=False) as pool:
            results = pool.evaluate_many(jobs)
            workers = [{"slot": w["slot"], "pid": w["pid"], "gpu": w["gpu"], "done": w["done"], "restarts": w["restarts"]} for w in pool.workers()]
    else:
        from kpipe.gym.distributed import RayGym

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


def placement_check(perf_trials: int, work: Path) -> tuple[list[str], bool, dict[str, Any]]:
    """One worker per GPU over a batch of legit kernels (each 2x per GPU), first on the pool,
    then on the Ray backend (one actor per GPU): placement, overlap, agreement."""
    devices = gpus()
    legit = [p for p in bank_pairs(None) if p["key"].endswith("/legit")][: min(6, LIMIT or 6)]
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


def caches_check(perf_trials: int, work: Path) -> tuple[list[str], bool, dict[str, Any]]:
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
    return lines, ok, {}


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text.replace("/", "of").replace("#", "-run").replace("+", "_and_").replace(",", "-"))


def parse_sections(spec: str) -> list[list[str]]:
    """`a,b+c:0/2` -> [["a", "b"], ["c:0/2"]]; each name checked, repeats labelled name#2."""
    lanes = [[s.strip() for s in lane.split(",") if s.strip()] for lane in spec.split("+")]
    for lane in lanes:
        for i, section in enumerate(lane):
            name, _, shard = section.partition(":")
            if name not in SECTIONS:
                raise ValueError(f"unknown section {name!r}; choose from {SECTIONS}")
            if shard and (name not in PATHS or not re.fullmatch(r"\d+/\d+", shard) or int(shard.split("/")[0]) >= int(shard.split("/")[1])):
                raise ValueError(f"bad shard {section!r}: K/N with 0 <= K < N, on {PATHS} only")
            runs = sum(1 for s in lane[:i] if s == section)
            if runs:
                lane[i] = f"{section}#{runs + 1}"
    if not lanes or not all(lanes):
        raise ValueError(f"empty lane in {spec!r}")
    return lanes


def shard_index(section: str) -> int:
    shard = section.split("#")[0].partition(":")[2]
    return int(shard.split("/")[0]) if shard else 0


def column_of(label: str) -> str:
    """The status-table column of a section: its path, and its run when repeated (pool#2)."""
    run = label.partition("#")[2]
    return label.split(":")[0].split("#")[0] + (f"#{run}" if run else "")


def shard_of(pairs: list[dict[str, Any]], section: str, start: float = 0.0) -> list[dict[str, Any]]:
    """Pairs K, K+N, ... of a shard, begun at fraction `start` of them and wrapped around: lanes
    sharing one GPU start at different places, so they do not reach the largest tasks (level 1's
    multi-GiB tensors) together and run out of GPU memory, which a lane alone never does."""
    shard = section.split("#")[0].partition(":")[2]
    chosen = pairs
    if shard:
        k, n = (int(x) for x in shard.split("/"))
        chosen = pairs[k::n]
    first = int(len(chosen) * start)
    return chosen[first:] + chosen[:first]


def run_lane(lane: list[str], pairs: list[dict[str, Any]], perf_trials: int, work: Path, header: list[str], start: float = 0.0) -> dict[str, Any]:
    """Run one lane's sections in order in this process: per section its rows (keyed by pair),
    wall time, cold/warm figures and check verdict; each saved under $OUT as it ends."""
    runners = {"pool": run_pool, "service": run_service, "ray": run_ray, "eval": run_eval}
    checks = {"placement": placement_check, "caches": caches_check}
    done: dict[str, Any] = {}
    for label in lane:
        name = label.split(":")[0].split("#")[0]
        tag = slug(label)
        started = time.monotonic()
        print(f"== {label} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'all')})", flush=True)
        if name in checks:
            try:
                lines, ok, extra = checks[name](perf_trials, work)
            except Exception as exc:  # noqa: BLE001 - the next section still runs
                lines, ok, extra = [f"- FAIL: {type(exc).__name__}: {exc}"], False, {}
            wall = time.monotonic() - started
            done[label] = {"check": name, "ok": ok, "lines": lines, "wall_s": round(wall, 1), **extra}
            gpu_harness.write_report(f"gym_paths_{tag}", "\n".join([*header, "", f"## {label} ({wall:.0f} s)", "", *lines]) + "\n", done[label])
            continue
        chosen = shard_of(pairs, label, start)
        runner = runners[name]
        if name == "eval" and shard_index(label) > 0:  # the CLI itself runs on the first shard's pairs only
            runner = functools.partial(run_eval, cli_pairs=0)
        try:
            rows, info = runner(chosen, perf_trials, work, tag)
        except Exception as exc:  # noqa: BLE001 - a path that cannot start fails its pairs, the next section still runs
            rows, info = [{"status": "?", "diagnostic": f"{name} failed: {type(exc).__name__}: {exc}"} for _ in chosen], {"error": str(exc)}
        wall = time.monotonic() - started
        for pair, row in zip(chosen, rows):
            row["pair"] = pair["key"]
        walls = [float(r.get("wall_s") or 0.0) for r in rows]
        figures = {"pairs": len(rows), "wall_s": round(wall, 1), "first_eval_s": round(walls[0], 1) if walls else None,
                   "median_eval_s": round(sorted(walls)[len(walls) // 2], 1) if walls else None,
                   "median_warm_eval_s": round(sorted(walls[1:])[len(walls[1:]) // 2], 1) if len(walls) > 1 else None,
                   "devices": sorted({str(r.get("device_id", "")).split(" ")[0] for r in rows if r.get("device_id")}), **info}
        lines, ok, _ = status_table(chosen, {label: {r["pair"]: r for r in rows}})
        done[label] = {"path": name, "column": column_of(label), "ok": ok, "rows": rows, **figures}
        summary = (f"- {label}: {len(rows)} evaluations in {wall:.0f} s (first {figures['first_eval_s']} s cold; warm median "
                   f"{figures['median_warm_eval_s']} s); expected statuses: {'all' if ok else 'NOT all'}")
        print(summary, flush=True)
        gpu_harness.write_report(f"gym_paths_{tag}", "\n".join([*header, summary, "", *lines]) + "\n", done[label])
    return done


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


def combined_report(pairs: list[dict[str, Any]], sections: dict[str, Any], lane_of: dict[str, str],
                    origin: dict[str, int] | None = None, folders: list[str] | None = None) -> tuple[list[str], bool]:
    """Per-section figures, then one status table over every path that ran (shards of one
    path merged; a repeated run is its own column). With `origin` (section -> index into
    `folders`, from --merge), a later folder's rows supersede an earlier one's per pair and
    column (`rows_per_path`), and the report says per column which folder each row came from."""
    origin = origin or {}
    by_path, source, superseded = rows_per_path(sections, origin)
    lines = ["| section | lane (GPU) | pairs | wall s | first eval s (cold) | warm median s | expected statuses |",
             "|---|---|---|---|---|---|---|"]
    ok = True
    for label, done in sections.items():
        if not superseded.get(label):  # a section a later folder reran in part is judged by the merged table
            ok &= bool(done.get("ok"))
        if "check" in done:
            lines.append(f"| {label} | {lane_of.get(label, '')} | — | {done['wall_s']} | — | — | {'ok' if done['ok'] else 'FAIL'} |")
            continue
        note = f" ({superseded[label]} superseded by a later folder)" if superseded.get(label) else ""
        lines.append(f"| {label} | {lane_of.get(label, '')} | {done['pairs']}{note} | {done['wall_s']} | {done['first_eval_s']} | "
                     f"{done['median_warm_eval_s']} | {'all' if done['ok'] else 'NOT all'} |")
    if by_path:
        table, agree, counts = status_table(pairs, by_path)
        ok &= agree
        lines += ["", "## Statuses per path", "", "Pairs run: " + ", ".join(f"{p} {n}/{len(pairs)}" for p, n in counts.items()), ""]
        if folders and len(folders) > 1:
            lines += ["Rows per path by folder (a later folder on the command line supersedes an earlier one's row of the same pair):", ""]
            for column, came in source.items():
                per = [sum(1 for rank in came.values() if rank == i) for i in range(len(folders))]
                lines.append(f"- {column}: " + ", ".join(f"{n} pairs from {folders[i]}" for i, n in enumerate(per) if n))
            lines.append("")
        lines += [*table, "", f"Every status run is the bank's expected one (so all paths agree per pair): {'yes' if agree else 'NO'}"]
    for label, done in sections.items():
        if "check" in done:
            lines += ["", f"## {label} ({done['wall_s']} s)", "", *done["lines"]]
    return lines, ok


def merge(dirs: list[Path], pairs: list[dict[str, Any]]) -> tuple[list[str], bool]:
    """The combined report from the gym_paths_*.json files of earlier runs (one per section);
    per path, a later folder's rows supersede an earlier folder's for the pairs it ran."""
    sections: dict[str, Any] = {}
    origin: dict[str, int] = {}
    expected = {p["key"]: p["expected"] for p in pairs}
    for rank, folder in enumerate(dirs):
        for path in sorted(folder.glob("gym_paths_*.json")):
            data = json.loads(path.read_text())
            stem = path.stem.removeprefix("gym_paths_")
            if stem.endswith(".partial"):  # an eval section that ran out of time: the pairs it finished
                if (folder / f"gym_paths_{stem.removesuffix('.partial')}.json").exists() or not isinstance(data, list):
                    continue
                data = {"path": "eval", "column": "eval", "rows": data, "pairs": len(data), "wall_s": None, "first_eval_s": None,
                        "median_warm_eval_s": None, "ok": all(r.get("status") == expected.get(r.get("pair")) for r in data)}
            if isinstance(data, dict) and ("path" in data or "check" in data) and "lanes" not in data:
                sections[f"{stem} ({folder})"] = data
                origin[f"{stem} ({folder})"] = rank
    return combined_report(pairs, sections, {}, origin, [str(d) for d in dirs])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="pool,service,ray,eval,placement,caches",
                        help="lanes separated by '+', sections in a lane by ','; a path may take a shard: eval:0/2")
    parser.add_argument("--perf-trials", type=int, default=20)
    parser.add_argument("--limit", type=int, default=None, help="first N bank pairs only (a quick try)")
    parser.add_argument("--stride", type=int, default=1, help="every K-th bank pair only (a quick try)")
    parser.add_argument("--pairs", default=None, metavar="KEYS",
                        help="only these pairs (after --limit/--stride): comma-separated keys as in the rows' 'pair' field, e.g. L1_19/legit,L1_47/wrong_dtype")
    parser.add_argument("--size-cap", type=int, default=None, help="shrink the problems (a CPU smoke test of the script)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan (lanes, GPUs, pairs per section) and stop")
    parser.add_argument("--merge", nargs="+", type=Path, help="combine the gym_paths_*.json of earlier runs' $OUT folders")
    parser.add_argument("--lane-result", type=Path, help=argparse.SUPPRESS)  # set for a lane's own process
    parser.add_argument("--start-fraction", type=float, default=0.0, help=argparse.SUPPRESS)  # where a lane sharing a GPU begins its pairs
    args = parser.parse_args()
    global SIZE_CAP, LIMIT
    SIZE_CAP, LIMIT = args.size_cap, args.limit
    try:
        lanes = parse_sections(args.sections)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        pairs = select_pairs(bank_pairs(None), args.limit, args.stride, args.pairs)
    except ValueError as exc:
        parser.error(str(exc))
    if args.merge:
        lines, ok = merge(args.merge, pairs)
        text = "\n".join([f"# KernelGym paths, merged from {', '.join(str(d) for d in args.merge)}", "", *lines]) + "\n"
        print(text, flush=True)
        gpu_harness.write_report("gym_paths_merged", text, {})
        sys.exit(gpu_harness.exit_status([] if ok else ["a merged path or check failed (table above)"]))
    devices = gpus()
    lane_gpus = [devices[i % len(devices)]["index"] if devices else None for i in range(len(lanes))] if len(lanes) > 1 else [None]
    plan = [f"lane {i} ({'GPU ' + g if g else 'every visible GPU' if len(lanes) == 1 else 'CPU'}): "
            + ", ".join(f"{s} ({len(shard_of(pairs, s)) if s.split(':')[0].split('#')[0] in PATHS else '-'} pairs)" for s in lane)
            for i, (lane, g) in enumerate(zip(lanes, lane_gpus))]
    if args.dry_run:
        print("\n".join([f"{len(pairs)} bank pairs{' (--pairs)' if args.pairs else ''}; GPUs: {[d['index'] + ' ' + d['name'] for d in devices] or 'none'}", *plan]))
        return
    fresh = gpu_harness.cold_caches(move_home=args.lane_result is None)
    work = Path(tempfile.mkdtemp(prefix="gym-paths-"))
    header = [f"# KernelGym paths from a cold start — {time.strftime('%Y-%m-%d')}, {', '.join(d['name'] for d in devices) or 'CPU'} x{len(devices)}", "",
              f"Empty caches at start: {fresh}; perf trials {args.perf_trials}, 5 correctness trials, eager baseline, "
              f"{'sizes capped at ' + str(SIZE_CAP) if SIZE_CAP else 'full KernelBench main sizes'}.", ""]
    started = time.monotonic()
    if len(lanes) == 1:
        sections = run_lane(lanes[0], pairs, args.perf_trials, work, header, args.start_fraction)
        if args.lane_result:  # a lane of a parent run: hand the sections back, the parent reports
            args.lane_result.write_text(json.dumps(sections, default=str))
            shutil.rmtree(work, ignore_errors=True)
            return
        lane_of = {label: "0 (all GPUs)" for label in sections}
    else:
        if len(lanes) > max(1, len(devices)):
            print(f"note: {len(lanes)} lanes on {len(devices)} GPU(s): lanes share GPUs, their timings are not clean", flush=True)
        procs = []
        for i, (lane, gpu) in enumerate(zip(lanes, lane_gpus)):
            env = dict(os.environ)  # the lane's process makes its own empty compile caches
            env["CUDA_VISIBLE_DEVICES"] = gpu if gpu is not None else ""
            result = work / f"lane{i}.json"
            passed = ["--perf-trials", str(args.perf_trials), "--stride", str(args.stride)]
            shared = sum(1 for g in lane_gpus if g == gpu)
            passed += ["--start-fraction", str(lane_gpus[:i].count(gpu) / shared)] if shared > 1 else []
            passed += ["--limit", str(args.limit)] if args.limit else []
            passed += ["--pairs", args.pairs] if args.pairs else []
            passed += ["--size-cap", str(args.size_cap)] if args.size_cap else []
            procs.append((subprocess.Popen([sys.executable, __file__, "--sections", ",".join(s.split("#")[0] for s in lane), "--lane-result", str(result), *passed], env=env), result, i, gpu))
        sections, lane_of = {}, {}
        for proc, result, i, gpu in procs:
            proc.wait()
            if result.exists():
                for label, done in json.loads(result.read_text()).items():
                    label = label if label not in sections else f"{label}@lane{i}"
                    sections[label] = done
                    lane_of[label] = f"{i} ({gpu if gpu is not None else 'CPU'})"
            else:
                sections[f"lane {i}"] = {"check": "lane", "ok": False, "wall_s": 0, "lines": [f"- lane {i} exited with {proc.returncode} and no result"]}
    lines, ok = combined_report(pairs, sections, lane_of)
    text = "\n".join([*header, *plan, f"Total wall: {time.monotonic() - started:.0f} s", "", "## Sections", "", *lines]) + "\n"
    print(text, flush=True)
    gpu_harness.write_report("gym_paths_summary-" + slug(args.sections), text, {"lanes": lanes, "sections": {k: {kk: vv for kk, vv in v.items() if kk != "rows"} for k, v in sections.items()}})
    shutil.rmtree(work, ignore_errors=True)
    sys.exit(gpu_harness.exit_status([] if ok else ["a path or check failed (sections above)"]))


if __name__ == "__main__":
    main()
