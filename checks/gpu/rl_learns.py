"""The whole RL loop learns on one GPU, judged by real GPU timing (issue 16, item 2).

    python3 -m checks.gpu rl_learns            # one H100, ~4-9 minutes
    python -m checks.gpu rl_learns --cpu       # smoke test of the path on a CPU
    python3 -m checks.gpu rl_learns --engine vllm --iterations 3   # RL rollouts on vLLM (issue 29)

Everything is compiled from nothing (the harness's empty compile caches). The default run's recipe
(``config/config.yaml``), through the library functions the DAG calls:

1. **Policy** (``policy.tiny``): ``kpipe.train.tiny_model.tiny_model_job``: the nano Qwen3 model
   with a 4,000-token BPE trained on the prompt templates, the bank and the KernelBench references.
2. **Cold start** (``distill``): ``kpipe.agent.distill.distill_shard`` with the offline teacher
   (``kpipe.llm.teacher.Teacher``, the bank's legit and buggy kernels; called in process instead of
   behind ``kpipe serve teacher``), 8 samples x 2 turns per task, every answer judged by KernelGym
   on this GPU (its feedback is the teacher's second prompt).
3. **SFT** (``sft``): ``kpipe.train.sft.train_sft`` on the first answers, 300 steps at lr 1e-2.
4. **RL** (``rl``): ``kpipe.train.rl.run_iteration``, ``--iterations`` iterations of one step,
   single turn, TRLOO, paper reward (1 + min(speedup, 3) when correct), 2 mini-batches x 2 PPO
   epochs at lr 3e-4, ``--rollouts`` rollouts per task (the default run: 16), every task every step,
   all rollouts of a step in one ``generate`` call; the optimizer state carries over.

Tasks: the default run's four training queries (L1_1, L1_88, L2_9, L2_86) plus L1_19 and L2_76,
at full KernelBench ``main`` sizes. The bank's legit kernel beats eager on an H100 for L1_88
(6.4x), L2_9, L2_76 and L2_86 (~1.5x), and does not for L1_1 (0.68x) or L1_19 (0.96x)
(docs/gpu-results/README.md), so Fast@1 can rise to about 4/6 of the rollouts.

KernelGym: the pool (one worker on the GPU), the full protocol (5 correctness trials, 10 warm-up +
100 timed trials, hacking checks, ghost replay), eager baseline only (as every RL reward), no
profiling (the reward has no PR term; ``--profile`` turns it on), each task's reference timed once
per worker (``reuse_reference``). The pool's SQLite result cache is on and shared by the
distillation and every iteration (``--no-result-cache`` turns it off): a program (same task,
same text) is timed on the GPU the first time it appears and later copies get that result, so an
iteration's evaluation seconds are those of its new programs; the report counts them.

The check: the mean reward and Fast@1 (correct, not hacked, speedup vs eager >= 1 at the turn:
``fast@1`` of ``train_metrics``) of the last iteration's rollouts exceed the first's, with the 95%
bootstrap interval of the difference (rollouts resampled within each task) above 0. Exit status 1
when either does not rise or fewer than ``--iterations`` iterations ran (``--budget-s`` stops before
an iteration that would not fit). ``--cpu`` (TRITON_INTERPRET=1, sizes capped at 48, a few steps)
reports the verdict without enforcing it: CPU timings make Fast@1 meaningless.

The report (per-iteration table: reward and Fast@1 with 95% intervals, statuses, new evaluations,
generation/evaluation/training seconds) is rewritten after every stage.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import sys
import tempfile
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

from checks.gpu.harness import CheckFailed, Report, Section

ROOT = Path(__file__).resolve().parents[2]
TITLE = "The RL loop learns"
STARTED = time.monotonic()
RUN = "gpu-learns"
FAST_TASKS = ((1, 88), (2, 9), (2, 76), (2, 86))  # bank legit faster than eager at full size on an H100
SLOW_TASKS = ((1, 1), (1, 19))  # bank legit slower than eager there
# the bank legit kernels' speedups under protocol kgym-3
# (git show 63b36f8:docs/gpu-results/kernelbench_side_by_side_2026-11-25_H100.md, median of five
# evaluations; L1_19 from gym_paths_2026-11-25_H100)
H100_LEGIT_SPEEDUP = {(1, 1): 0.70, (1, 19): 0.99, (1, 88): 8.87, (2, 9): 1.44, (2, 76): 1.48, (2, 86): 1.42}
STEP_METRICS = ("gen_s", "eval_s", "train_s", "step_s", "overlap_s", "reward_mean", "correct_frac", "fast@1",
                "entropy", "kept_frac", "grad_norm", "response_tokens_mean", "rollout_ppl", "train_ppl",
                "mismatch_abs_log_w", "kept_frac_mrs")
N_BOOT = 2000


def add_options(parser: argparse._ArgumentGroup) -> None:
    parser.add_argument("--cpu", action="store_true",
                        help="smoke test: TRITON_INTERPRET=1, sizes capped, 2 tasks, a few steps, verdict not enforced")
    parser.add_argument("--tasks", help="LEVEL:ID,... (default: 1:88,2:9,2:76,2:86,1:1,1:19; --cpu: 1:19,1:88)")
    parser.add_argument("--iterations", type=int, help="RL iterations (default 5; --cpu 2)")
    parser.add_argument("--rollouts", type=int, help="rollouts per task per iteration (default 8; --cpu 2)")
    parser.add_argument("--samples", type=int,
                        help="cold-start samples per task (default: distill.samples, 8; --cpu 2)")
    parser.add_argument("--distill-turns", type=int, help="cold-start turns (default: distill.turns, 2; --cpu 1)")
    parser.add_argument("--sft-steps", type=int, help="SFT steps (default: sft.max_steps, 300; --cpu 3)")
    parser.add_argument("--max-tokens", type=int, help="tokens per rollout (default: rl.max_tokens, 256; --cpu 24)")
    parser.add_argument("--size-cap", type=int, help="cap on the tasks' size constants (default: none; --cpu 48)")
    parser.add_argument("--async", dest="async_mode", default="off", choices=("off", "eval", "off_policy_1"),
                        help="rl.async (default off: nothing else runs on the GPU while a kernel is timed, and the "
                             "generation, evaluation and training seconds add up to the step)")
    parser.add_argument("--engine", default="hf", choices=("hf", "vllm"),
                        help="rl.engine: HF generate on the live policy (default), or vLLM in this process (one "
                             "engine for every iteration, the trainer's weights pushed into it; vLLM 0.26 installed "
                             "as docs/vllm-on-the-device.md says)")
    parser.add_argument("--profile", action="store_true", help="profile every kernel (PR); off: the reward has no PR")
    parser.add_argument("--no-result-cache", action="store_true",
                        help="no SQLite result cache: a program seen in an earlier iteration is evaluated again")
    parser.add_argument("--enforce", action=argparse.BooleanOptionalAction, default=None,
                        help="exit 1 unless reward and Fast@1 rise (default: on, off with --cpu)")
    parser.add_argument("--keep-work", action="store_true", help="keep the models and Parquet files (printed path)")


def resolve_defaults(args: argparse.Namespace, config: dict[str, Any]) -> None:
    """Settings left unset take the smoke run's values with --cpu, else the full run's, then the
    default run's (config/config.yaml); --budget-s stops before an RL iteration that would end past it."""
    smoke = {"tasks": "1:19,1:88", "iterations": 2, "rollouts": 2, "samples": 2, "distill_turns": 1, "sft_steps": 3,
             "max_tokens": 24, "size_cap": 48, "budget_s": None}
    full = {"tasks": ",".join(f"{level}:{pid}" for level, pid in FAST_TASKS + SLOW_TASKS), "iterations": 5,
            "rollouts": 8, "samples": None, "distill_turns": None, "sft_steps": None, "max_tokens": None,
            "size_cap": None, "budget_s": 540.0}
    for key, value in (smoke if args.cpu else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.enforce is None:
        args.enforce = not args.cpu
    defaults = {"samples": config["distill"]["samples"], "distill_turns": config["distill"]["turns"],
                "sft_steps": config["sft"]["max_steps"], "max_tokens": config["rl"]["max_tokens"]}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, int(value))


def elapsed() -> float:
    return time.monotonic() - STARTED


def say(message: str) -> None:
    print(f"[{elapsed():6.0f} s] {message}", flush=True)


class TeacherEngine:
    """The offline teacher as an in-process engine (what `kpipe serve teacher` puts behind HTTP)."""

    def __init__(self, teacher: Any, model: str) -> None:
        self.teacher, self.model = teacher, model

    def generate(self, requests: list[Any], on_result: Any = None) -> list[Any]:
        completions = []
        for index, request in enumerate(requests):
            completions.append(self.teacher.respond(request))
            if on_result is not None:
                on_result(index, completions[-1])
        return completions


class CountingEvaluator:
    """The pool, counting the jobs it is handed: `new` the first time a (reference, program) pair
    appears in this run (with the result cache on, the GPU evaluations; later copies are answered
    from the cache), `unique` per call (without the cache, the GPU evaluations), and the seconds."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.seen = inner, set()
        self.jobs = self.unique = self.new = 0
        self.seconds = 0.0

    def evaluate_many(self, jobs: list[tuple[str, str]]) -> list[Any]:
        jobs = list(jobs)
        keys = {hashlib.sha256("\0".join(job).encode()).hexdigest() for job in jobs}
        self.jobs += len(jobs)
        self.unique += len(keys)
        self.new += len(keys - self.seen)
        self.seen |= keys
        started = time.perf_counter()
        try:
            return self.inner.evaluate_many(jobs)
        finally:
            self.seconds += time.perf_counter() - started

    def snapshot(self) -> dict[str, float]:
        return {"jobs": self.jobs, "unique": self.unique, "new": self.new, "seconds": self.seconds}


def since(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {key: after[key] - before[key] for key in after}


# --------------------------------------------------------------------------- statistics (pure)


def rollout_frame(rows: Any) -> Any:
    """Per rollout: task, reward and the Fast@1 indicator (correct, not hacked, speedup_eager >= 1:
    kpipe.data.metrics.is_fast, as the `fast@1` metric counts)."""
    import pandas as pd

    from kpipe.data.metrics import is_fast

    frame = pd.DataFrame(rows)
    speedup = pd.to_numeric(frame["speedup_eager"], errors="coerce").to_numpy(float)
    frame["fast1"] = is_fast(frame["correct"].fillna(False).to_numpy(bool), speedup, 1.0,
                             frame["hacked"].fillna(False).to_numpy(bool)).astype(float)
    frame["reward"] = frame["reward"].astype(float)
    return frame


def stratified_means(frame: Any, column: str, n_boot: int, rng: Any) -> Any:
    """`n_boot` bootstrap replicates of the mean of `column`, rollouts resampled within each task."""
    import numpy as np

    total = np.zeros(n_boot)
    for _, group in frame.groupby("task_id"):
        values = group[column].to_numpy(float)
        total += values[rng.integers(0, len(values), (n_boot, len(values)))].sum(axis=1)
    return total / len(frame)


def interval(frame: Any, column: str, n_boot: int = N_BOOT, seed: int = 0) -> dict[str, float]:
    import numpy as np

    replicates = stratified_means(frame, column, n_boot, np.random.default_rng(seed))
    low, high = np.quantile(replicates, [0.025, 0.975])
    return {"mean": float(frame[column].mean()), "low": float(low), "high": float(high)}


def rise(first: Any, last: Any, column: str, n_boot: int = N_BOOT, seed: int = 0) -> dict[str, Any]:
    """Last minus first iteration's mean of `column`, with a 95% bootstrap interval; rises when the
    interval's lower end is above 0."""
    import numpy as np

    rng = np.random.default_rng(seed)
    diff = stratified_means(last, column, n_boot, rng) - stratified_means(first, column, n_boot, rng)
    low, high = np.quantile(diff, [0.025, 0.975])
    return {"first": float(first[column].mean()), "last": float(last[column].mean()),
            "diff": float(last[column].mean() - first[column].mean()), "low": float(low), "high": float(high),
            "rises": bool(low > 0)}


def verdict(frames: list[Any], iterations: int) -> dict[str, Any]:
    """Reward and Fast@1 of the last iteration against the first; `ok` when both rise and all
    `iterations` ran."""
    if len(frames) < 2:
        return {"ok": False, "iterations_run": len(frames), "why": "fewer than 2 iterations ran"}
    result: dict[str, Any] = {"iterations_run": len(frames), "reward": rise(frames[0], frames[-1], "reward"),
                              "fast@1": rise(frames[0], frames[-1], "fast1")}
    why = [f"{name} does not rise" for name in ("reward", "fast@1") if not result[name]["rises"]]
    if len(frames) < iterations:
        why.append(f"only {len(frames)} of {iterations} iterations ran")
    result.update(ok=not why, why="; ".join(why) or "reward and Fast@1 rise")
    return result


# --------------------------------------------------------------------------- report


def fmt_ci(ci: dict[str, float]) -> str:
    return f"{ci['mean']:.3f} [{ci['low']:.3f}, {ci['high']:.3f}]"


def markdown(report: dict[str, Any]) -> list[str]:
    settings = report["settings"]
    smoke = ("CPU smoke run: every timing is a Triton-interpreter timing (Fast@1 meaningless). "
             if settings["cpu"] else "")
    sizes = f"sizes capped at {settings['size_cap']}" if settings["size_cap"] else "full KernelBench main sizes"
    cache = "off" if settings["no_result_cache"] else "on (a program is timed once, at its first appearance)"
    lines = [
        f"`python -m checks.gpu rl_learns{' --cpu' if settings['cpu'] else ''}"
        f"{' --engine ' + settings['engine'] if settings.get('engine', 'hf') != 'hf' else ''}`. "
        f"{smoke}Tasks ({sizes}): "
        f"{', '.join(report['tasks'])}. Recipe: config/config.yaml's default run (nano Qwen3, 4,000-token BPE; "
        f"teacher cold start {settings['samples']} samples x {settings['distill_turns']} turns; SFT "
        f"{settings['sft_steps']} steps on the first answers; RL {settings['iterations']} iterations x "
        f"{len(report['tasks'])} tasks x {settings['rollouts']} single-turn rollouts, TRLOO, paper reward).",
        f"KernelGym: pool, one worker, protocol {report['protocol_summary']}; reference timed once per task; "
        f"result cache {cache}. RL rollouts: rl.async {report.get('rl_config', {}).get('async_mode', '?')} "
        "(off: each turn's answers are evaluated after all are generated, nothing else on the GPU while a kernel "
        "is timed; generation + evaluation + training make up the step).",
        "", "### Stages", "", "| stage | seconds | what |", "|---|---|---|",
    ]
    for stage in report["stages"]:
        lines.append(f"| {stage['stage']} | {stage['seconds']:.1f} | {stage.get('what', '')} |")
    if report["iterations"]:
        lines += ["", "### Per iteration (95% bootstrap intervals, rollouts resampled within each task)", "",
                  "| iteration | rollouts | mean reward | pass rate | Fast@1 | statuses | new programs evaluated "
                  "| generation s | evaluation s | training s | step s | iteration wall s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for it in report["iterations"]:
            statuses = ", ".join(f"{k} {v}" for k, v in sorted(it["statuses"].items(), key=lambda kv: -kv[1]))
            lines.append(
                f"| {it['iteration']} | {it['rollouts']} | {fmt_ci(it['reward'])} | {it['pass_rate']:.1%} | "
                f"{fmt_ci(it['fast@1'])} | {statuses} | {it['evaluations']['new']} | {it['step']['gen_s']:.1f} | "
                f"{it['step']['eval_s']:.1f} | {it['step']['train_s']:.1f} | {it['step']['step_s']:.1f} | "
                f"{it['wall_s']:.1f} |")
        if any("rollout_ppl" in it["step"] for it in report["iterations"]):
            lines += ["", f"### Rollout engine ({settings.get('engine', 'hf')}) vs trainer (Figure 7)", "",
                      "| iteration | rollout ppl | trainer ppl | mean abs log w | MRS would keep |", "|---|---|---|---|---|"]
            for it in report["iterations"]:
                st = it["step"]
                lines.append(f"| {it['iteration']} | {st.get('rollout_ppl', float('nan')):.4f} | "
                             f"{st.get('train_ppl', float('nan')):.4f} | {st.get('mismatch_abs_log_w', float('nan')):.3g} | "
                             f"{st.get('mrs_would_keep', float('nan')):.3f} |")
        first, last = report["iterations"][0], report["iterations"][-1]
        lines += ["", f"### Per task (iteration {first['iteration']} -> {last['iteration']})", "",
                  "| task | legit speedup on an H100 (docs) | median speedup of its correct kernels here "
                  "| pass | Fast@1 |", "|---|---|---|---|---|"]
        for task in report["tasks"]:
            a, b = first["per_task"].get(task, {}), last["per_task"].get(task, {})
            here = report["task_speedups"].get(task)
            measured = "" if here is None else f"{here:.2f}"
            lines.append(f"| {task} | {report['docs_speedups'].get(task, '')} | {measured} | "
                         f"{a.get('pass', 0):.2f} -> {b.get('pass', 0):.2f} | "
                         f"{a.get('fast1', 0):.2f} -> {b.get('fast1', 0):.2f} |")
    check = report.get("verdict")
    if check:
        lines += ["", "### Verdict", ""]
        for name in ("reward", "fast@1"):
            if name in check:
                r = check[name]
                lines.append(f"- {name}: {r['first']:.3f} -> {r['last']:.3f}, difference {r['diff']:+.3f} "
                             f"[{r['low']:+.3f}, {r['high']:+.3f}]: {'rises' if r['rises'] else 'does NOT rise'}")
        enforced = "" if report["settings"]["enforce"] else " (not enforced: smoke run)"
        lines.append(f"- **{'PASS' if check['ok'] else 'FAIL'}**: {check['why']}{enforced}")
    if report.get("stopped"):
        lines += ["", f"Stopped early: {report['stopped']}"]
    lines += ["", f"Wall time of the check: {report['wall_s']:.0f} s."]
    return lines


def save(report: dict[str, Any], sink: Report) -> None:
    """The tables so far into the harness's report, saved (a run stopped early keeps its JSON)."""
    report["wall_s"] = elapsed()
    sink.current["data"] = report
    sink.rewrite(*(markdown(report) if "verdict" in report else ["(stopped before the first RL iteration ended)"]))


# --------------------------------------------------------------------------- the run


def load_config() -> dict[str, Any]:
    import yaml

    return yaml.safe_load((ROOT / "config" / "config.yaml").read_text())


def make_tasks(spec: str, size_cap: int | None) -> list[Any]:
    from kpipe.agent.loop import AgentTask
    from kpipe.data.kernelbench import load_problems, shrink_sizes

    problems = {(p.level, p.problem_id): p for p in load_problems("main")}
    tasks = []
    for item in spec.split(","):
        level, pid = (int(part) for part in item.split(":"))
        code = problems[(level, pid)].code
        tasks.append(AgentTask(f"kb-main-L{level}-{pid}", shrink_sizes(code, size_cap) if size_cap else code))
    return tasks


def task_label(task_id: str) -> str:
    level, pid = task_id.rsplit("-", 2)[-2:]
    return f"{level}_{pid}"


def run(args: argparse.Namespace, config: dict[str, Any], sink: Report, work: Path, report: dict[str, Any]) -> None:
    import torch

    from kpipe.agent.distill import OFFLINE_TEACHER_MODEL, distill_shard
    from kpipe.agent.evaluator import open_evaluator
    from kpipe.agent.loop import Sampling
    from kpipe.data.io import read_table
    from kpipe.gym import Protocol
    from kpipe.llm.teacher import Teacher, TeacherBehaviour
    from kpipe.train.rl import run_iteration
    from kpipe.train.rl_config import IterationSettings, RLConfig
    from kpipe.train.sft import SFTConfig, train_sft
    from kpipe.train.tiny_model import tiny_model_job

    if args.cpu:
        torch.set_num_threads(1)  # a shared CPU: more threads make torch far slower (tests/conftest.py)
    tasks = make_tasks(args.tasks, args.size_cap)
    labels = [task_label(t.task_id) for t in tasks]
    report["tasks"] = labels
    report["docs_speedups"] = {f"L{lv}_{pid}": s for (lv, pid), s in H100_LEGIT_SPEEDUP.items()}

    def stage(name: str, started: float, what: str = "") -> None:
        report["stages"].append({"stage": name, "seconds": time.monotonic() - started, "what": what})
        save(report, sink)

    # KernelGym: the gym section's protocol on the CPU, the paper's on the GPU; eager only, as RL uses
    base_protocol = dict(config["gym"]["protocol"]) if args.cpu else {}
    protocol = Protocol.from_dict({**base_protocol, "baseline": "eager", "profile": args.profile})
    report["protocol"] = protocol.to_dict()
    report["protocol_summary"] = (f"{protocol.correct_trials} correctness trials, {protocol.warmup} warm-up + "
                                  f"{protocol.perf_trials} timed trials, eager baseline, hacking checks "
                                  f"{'on' if protocol.hacking_check else 'off'}, profiling "
                                  f"{'on' if protocol.profile else 'off'}")
    gym = {"backend": "pool", "workers": 1, "protocol": protocol.to_dict(),
           "cache": None if args.no_result_cache else str(work / "results.sqlite")}

    started = time.monotonic()
    tiny = config["policy"]["tiny"]
    base = tiny_model_job(work / "base", size=tiny["size"], seed=tiny["seed"], tokenizer=tiny["tokenizer"],
                          vocab_size=tiny["vocab_size"])
    stage("policy (BPE tokenizer + nano model)", started, f"{tiny['size']}, {tiny['vocab_size']}-token BPE")

    started = time.monotonic()
    with open_evaluator(gym, reuse_reference=True, progress=False) as pool:
        evaluator = CountingEvaluator(pool)
        stage("KernelGym pool start", started, "one worker")

        # ---- cold start: the offline teacher, judged by KernelGym
        started = time.monotonic()
        distill = config["distill"]
        offline = distill.get("offline", {})
        teacher = Teacher.from_bank(behaviour=TeacherBehaviour(offline.get("p_first_legit", 0.3),
                                                               offline.get("p_fix", 0.7)))
        coldstart = work / "coldstart.parquet"
        distill_shard(tasks, TeacherEngine(teacher, OFFLINE_TEACHER_MODEL), evaluator, coldstart,
                      work / "teacher-cache.sqlite", run=RUN, n_turns=args.distill_turns, n_samples=args.samples,
                      sampling=Sampling(**distill.get("sampling", {})), seed=int(distill.get("seed", 0)),
                      eval_namespace=protocol.to_json(), progress=False)
        rows = read_table(coldstart, "trajectories").to_pylist()
        first = [r for r in rows if r["turn"] == 1]
        statuses: dict[str, int] = {}
        for row in first:
            statuses[row["status"]] = statuses.get(row["status"], 0) + 1
        correct = {}
        for row in rows:
            if row["correct"] and not row["hacked"] and row["speedup_eager"] is not None:
                correct.setdefault(task_label(row["task_id"]), []).append(float(row["speedup_eager"]))
        report["task_speedups"] = {task: sorted(v)[len(v) // 2] for task, v in correct.items()}
        report["coldstart"] = {"turns": len(rows), "first_answers": len(first), "first_statuses": statuses,
                               "first_pass_rate": sum(r["correct"] for r in first) / len(first),
                               "evaluations": evaluator.snapshot()}
        stage("cold start (teacher + KernelGym)", started,
              f"{len(rows)} turns; first answers {statuses}; {evaluator.new} programs evaluated")
        say(f"cold start: {len(rows)} turns, first answers {statuses}, {evaluator.new} programs evaluated, "
            f"median speedup of correct programs {report['task_speedups']}")

        # ---- SFT on the first answers
        started = time.monotonic()
        sft_values = {key: value for key, value in config["sft"].items() if key != "gpus"}
        sft_values.update(base_model=str(base), run=RUN, max_steps=args.sft_steps, save_every=0)
        # its progress bar refreshes every step (set_postfix): to a log file, not the output's tail
        with open(work / "sft.log", "w") as log, contextlib.redirect_stderr(log):
            sft = train_sft(SFTConfig.from_dict(sft_values), rows, work / "sft", work / "sft_metrics.parquet")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        report["sft"] = {"steps": sft.steps, "final_loss": sft.final_loss}
        stage("SFT", started, f"{sft.steps} steps, final loss {sft.final_loss:.4f}")
        say(f"SFT: {sft.steps} steps, final loss {sft.final_loss:.4f}")

        # ---- RL
        known = {item.name for item in fields(RLConfig)}
        rl_values = {key: value for key, value in config["rl"].items() if key in known or key == "async"}
        rollouts = len(tasks) * args.rollouts
        rl_values.update(prompts_per_step=len(tasks), rollouts_per_prompt=args.rollouts, max_tokens=args.max_tokens,
                         generation_batch_size=rollouts, engine=args.engine)
        if "async_mode" in known:
            rl_values.pop("async", None)
            rl_values["async_mode"] = args.async_mode
        else:  # an RLConfig from before rl.async: the agent loop's default (evaluation overlaps generation)
            rl_values.pop("async", None)
            say(f"RLConfig has no async_mode: --async {args.async_mode} ignored, the agent loop's default applies")
        cfg = RLConfig.from_dict(rl_values)
        report["rl_config"] = {**rl_values, "async_mode": getattr(cfg, "async_mode", "loop default (overlap)")}
        model, state, frames, durations = sft.model_dir, None, [], []
        for iteration in range(args.iterations):
            if args.budget_s and durations and elapsed() + 1.15 * max(durations) > args.budget_s:
                report["stopped"] = (f"before iteration {iteration}: {elapsed():.0f} s spent, the slowest iteration "
                                     f"took {max(durations):.0f} s, budget {args.budget_s:.0f} s")
                say(report["stopped"])
                break
            started = time.monotonic()
            before = evaluator.snapshot()
            it_dir = work / f"iter={iteration}"
            run_iteration(IterationSettings(cfg=cfg, tasks=tuple(tasks), init_model=model, model_out=it_dir / "model",
                                            trajectories=it_dir / "trajectories.parquet",
                                            metrics=it_dir / "metrics.parquet", scratch=it_dir / "scratch", run=RUN,
                                            iteration=iteration, init_state=state, state_out=it_dir / "state",
                                            gym={"protocol": protocol.to_dict()}, progress=False), evaluator=evaluator)
            if state is not None:
                shutil.rmtree(state, ignore_errors=True)  # the next iteration needs only this one's
            model, state = it_dir / "model", it_dir / "state"
            durations.append(time.monotonic() - started)
            metrics = read_table(it_dir / "metrics.parquet", "train_metrics").to_pandas()
            step = {name: float(value) for name, value in zip(metrics.name, metrics.value) if name in STEP_METRICS}
            trajectories = read_table(it_dir / "trajectories.parquet", "trajectories").to_pylist()
            frame = rollout_frame(trajectories)
            frames.append(frame)
            per_task = {task_label(task): {"pass": float(group["correct"].mean()),
                                           "fast1": float(group["fast1"].mean())}
                        for task, group in frame.groupby("task_id")}
            for row in trajectories:
                if row["correct"] and not row["hacked"] and row["speedup_eager"] is not None:
                    correct.setdefault(task_label(row["task_id"]), []).append(float(row["speedup_eager"]))
            report["task_speedups"] = {task: sorted(v)[len(v) // 2] for task, v in correct.items()}
            entry = {"iteration": iteration, "rollouts": len(frame), "reward": interval(frame, "reward"),
                     "fast@1": interval(frame, "fast1"), "pass_rate": float(frame["correct"].mean()),
                     "statuses": frame["status"].fillna("none").value_counts().to_dict(), "step": step,
                     "evaluations": since(before, evaluator.snapshot()), "wall_s": durations[-1],
                     "per_task": per_task}
            report["iterations"].append(entry)
            report["verdict"] = verdict(frames, args.iterations)
            stage(f"RL iteration {iteration}", started, f"reward {entry['reward']['mean']:.3f}, "
                  f"Fast@1 {entry['fast@1']['mean']:.3f}")
            say(f"RL iteration {iteration}: reward {fmt_ci(entry['reward'])}, Fast@1 {fmt_ci(entry['fast@1'])} "
                f"(metric {step.get('fast@1', float('nan')):.3f}), pass {entry['pass_rate']:.1%}, "
                f"{entry['evaluations']['new']} new programs; gen {step['gen_s']:.1f} s, eval {step['eval_s']:.1f} s, "
                f"train {step['train_s']:.1f} s, iteration {durations[-1]:.1f} s")
    report["verdict"] = verdict(frames, args.iterations)


def learns(sink: Report, args: argparse.Namespace) -> None:
    """The last RL iteration's mean reward and Fast@1 rise above the first's (95 % bootstrap interval
    of the difference above 0), over every iteration asked for."""
    config = load_config()
    resolve_defaults(args, config)
    if args.cpu:
        os.environ["TRITON_INTERPRET"] = "1"  # read by the evaluation children this process starts
    elif sink.facts["device"] == "cpu":
        raise CheckFailed("no GPU visible: run with --cpu for the smoke test")
    if args.engine == "vllm":
        if args.cpu or sink.facts["device"] == "cpu":
            raise CheckFailed("--engine vllm needs a GPU and vLLM (docs/vllm-on-the-device.md); --cpu runs HF only")
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise CheckFailed("--engine vllm: vLLM is not importable (install it into /tmp/site and put that on "
                              "PYTHONPATH, docs/vllm-on-the-device.md)")
        # FlashInfer is not installed on the device (docs/vllm-on-the-device.md); no usage-stats request
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("TQDM_MININTERVAL", "30")  # progress bars: a line every 30 s, not a flood
    work = Path(tempfile.mkdtemp(prefix="kpipe-rl-learns-"))
    report: dict[str, Any] = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                              "stages": [], "iterations": [], "task_speedups": {}}
    say(f"{sink.facts['device']}: work in {work}")
    try:
        run(args, config, sink, work, report)
    finally:
        save(report, sink)
        if not args.keep_work:
            shutil.rmtree(work, ignore_errors=True)
    check = report["verdict"]
    if args.enforce:
        sink.expect(check["ok"], check["why"])
    elif not check["ok"]:
        print(f"not enforced (smoke run): {check['why']}", file=sys.stderr)


SECTIONS = (Section("learns", 240, learns),)


def figures(report: dict[str, Any]) -> dict[str, Any]:
    """The ledger's figures: the mean reward and Fast@1 at the first and last iteration."""
    verdict = report["sections"].get("learns", {}).get("data", {}).get("verdict", {})
    return {f"{name}_{end}": round(verdict[name][end], 3) for name in ("reward", "fast@1") if name in verdict
            for end in ("first", "last")}
