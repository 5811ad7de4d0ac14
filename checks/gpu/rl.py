"""One RL iteration (kpipe.train.rl.run_iteration) with real KernelGym evaluation on one GPU: the
time of one step split into generation, evaluation and training, per `rl.async` mode.

    python3 -m checks.gpu rl                                  # ~4 minutes on one H100
    python3 -m checks.gpu rl --async off eval off             # before/after overlap
    python3 -m checks.gpu rl --async off off_policy_1 off --steps 2   # one-step off-policy

1. Builds a Qwen3-0.6B-sized model from config (random weights, no download) with a BPE
   tokenizer trained on the prompts and the bank's kernels, and SFTs it (kpipe.train.sft) on the
   bank's correct and buggy kernels of two KernelBench tasks until it reproduces them, so that
   its rollouts contain programs KernelGym actually runs (a random-init policy writes none).
2. Runs one RL iteration of `--steps` steps per `--async` mode, from the same SFT model, seeds and
   warm GPU evaluation pool: HF `generate` rollouts with per-token log-probs, KernelGym with the
   paper's protocol (5 correctness trials, 100 timed trials, hacking checks, profiling for PR),
   rewards with PR (Eq. 8), PRS (Eq. 9), TRLOO, and the PPO-clip update under bf16 autocast.
3. Prints each mode's time split (generation, evaluation, training, step wall time, and overlap_s:
   what running them alongside each other saved) and statistics from `train_metrics`, whether the
   first turn's answers are the same across modes (the overlap must not change what is sampled: the
   check fails when they are not).

On a CPU (to check the check itself): ``TRITON_INTERPRET=1 python -m checks.gpu rl
--size nano --size-cap 48 --sft-steps 2 --max-tokens 16 --rollouts 2``. ``--size nano --lr 1e-2``
is the offline learning check's policy (tests/test_rl_learning.py) at full speed.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from checks.gpu.harness import Report, Section

TITLE = "RL iteration check"
TASKS = ((1, 19), (1, 88))  # KernelBench L1 ReLU and MinGPT GELU: the bank's shortest kernels
STEP_METRICS = ("gen_s", "eval_s", "rollout_s", "train_s", "step_s", "overlap_s", "policy_lag", "rows", "trained_rows", "reward_mean",
                "correct_frac", "hacking_ratio", "fast@1", "kept_frac", "kept_frac_prs", "response_tokens_mean",
                "rollout_ppl", "train_ppl", "mismatch_abs_log_w", "entropy", "grad_norm", "optimizer_steps")


def sft_rows(tasks: list) -> list[dict]:
    """One SFT row per bank solution (correct and buggy) of each task, as cold-start turns."""
    from kpipe.gym.bank import solutions_for
    from kpipe.llm.prompts import first_turn_messages

    rows = []
    for task, (level, problem_id) in zip(tasks, TASKS, strict=True):
        messages = first_turn_messages(task.reference_src)
        for index, solution in enumerate(solutions_for(level, problem_id)):
            rows.append({"run": "gpu-check", "stage": "coldstart", "iteration": 0, "task_id": task.task_id,
                         "sample": index, "turn": 1, "prompt_messages": messages,
                         "response": f"```python\n{solution.source.strip()}\n```", "status": solution.expected_status,
                         "correct": solution.variant == "legit"})
    return rows


def add_options(parser: argparse._ArgumentGroup) -> None:
    parser.add_argument("--size", default="qwen3-0.6b", help="kpipe.train.tiny_model size preset")
    parser.add_argument("--size-cap", type=int, default=4096, help="cap on the tasks' module-level size constants")
    parser.add_argument("--sft-steps", type=int, default=500)
    parser.add_argument("--lr", type=float, default=1e-3, help="SFT learning rate")
    parser.add_argument("--vocab", type=int, default=800,
                        help="BPE tokenizer size (larger ones merge whole answers of this small corpus into single tokens)")
    parser.add_argument("--rollouts", type=int, default=8, help="rollouts per prompt (2 prompts)")
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=400, help="generated tokens per turn")
    parser.add_argument("--async", dest="modes", nargs="+", default=["off"], choices=("off", "eval", "off_policy_1"),
                        help="rl.async modes to run, one iteration each, in this order; the first also warms up "
                             "CUDA and generate(), so repeat it last (e.g. off eval off) for a fair comparison")
    parser.add_argument("--steps", type=int, default=1, help="steps per iteration (off_policy_1 overlaps from the 2nd)")
    parser.add_argument("--generation-batch-size", type=int, default=16,
                        help="HF sequences per generate() call (16: a turn's answers in one call)")


def rl_step(report: Report, args: argparse.Namespace) -> None:
    """Every rl.async mode samples the same first turns (overlap must not change what is sampled);
    the step's time split is the report's figure."""
    import torch

    from kpipe.agent.evaluator import open_evaluator
    from kpipe.agent.loop import AgentTask
    from kpipe.data.io import read_table
    from kpipe.data.kernelbench import load_problems, shrink_sizes
    from kpipe.train.rl import gym_protocol, run_iteration
    from kpipe.train.rl_config import IterationSettings, RLConfig
    from kpipe.train.sft import SFTConfig, train_sft
    from kpipe.train.tiny_model import build_tiny_model

    problems = {(p.level, p.problem_id): p for p in load_problems("main")}
    tasks = [AgentTask(f"kb-main-L{level}-{pid}", shrink_sizes(problems[(level, pid)].code, args.size_cap))
             for level, pid in TASKS]
    timings: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="kpipe-rl-check-") as tmp:
        root = Path(tmp)
        started = time.perf_counter()
        rows = sft_rows(tasks)
        corpus = [m["content"] for row in rows for m in row["prompt_messages"]] + [row["response"] for row in rows]
        base = build_tiny_model(root / "base", seed=0, size=args.size, corpus=corpus, vocab_size=args.vocab)
        sft = train_sft(SFTConfig(base_model=str(base), run="gpu-check", lr=args.lr, batch_size=len(rows),
                                  epochs=args.sft_steps, max_steps=args.sft_steps, max_length=8192,
                                  micro_batch_tokens=16384, warmup_ratio=0.05, schedule="constant",
                                  weight_decay=0.0, seed=0),
                        rows, root / "sft", root / "sft_metrics.parquet")
        timings["build_and_sft_s"] = time.perf_counter() - started
        gc.collect()  # the SFT trainer's model and optimizer sit in reference cycles (accelerate)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            print(f"GPU memory after SFT: {torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated", flush=True)
        print(f"SFT: {sft.steps} steps on {len(rows)} kernels, final loss {sft.final_loss:.4f} "
              f"({timings['build_and_sft_s']:.0f} s)", flush=True)

        settings = RLConfig(prompts_per_step=len(tasks), rollouts_per_prompt=args.rollouts, max_turns=args.turns,
                            max_tokens=args.max_tokens, use_pr=True, prs=True,
                            generation_batch_size=args.generation_batch_size,
                            micro_batch_tokens=16384, steps_per_iteration=args.steps)
        gym = {"backend": "pool", "cache": None, "protocol": gym_protocol(settings, {"baseline": "eager"}).to_dict()}
        runs: dict[str, dict] = {}
        # one warm pool for every mode: no start-up in the comparison
        with open_evaluator(gym, reuse_reference=not torch.cuda.is_available()) as pool:
            for index, mode in enumerate(args.modes):
                label = mode if args.modes.count(mode) == 1 else f"{mode} ({args.modes[:index + 1].count(mode)})"
                cfg = replace(settings, async_mode=mode)
                out = root / f"rl-{index}"
                started = time.perf_counter()
                run_iteration(IterationSettings(cfg=cfg, tasks=tuple(tasks), init_model=sft.model_dir,
                                                model_out=out / "model", trajectories=out / "trajectories.parquet",
                                                metrics=out / "metrics.parquet", scratch=out / "scratch",
                                                run="gpu-check", iteration=0, gym=gym), evaluator=pool)
                metrics = read_table(out / "metrics.parquet", "train_metrics").to_pandas()
                trajectories = read_table(out / "trajectories.parquet", "trajectories").to_pandas()
                runs[label] = {
                    "iteration_s": time.perf_counter() - started,
                    "steps": {int(step): {name: float(value) for name, value in zip(group.name, group.value)
                                          if name in STEP_METRICS} for step, group in metrics.groupby("step")},
                    "statuses": trajectories.status.value_counts().to_dict(),
                    # step 1's first turns (rows are in step order): sampled before any feedback
                    "first_turns": [tuple(ids) for ids in trajectories[trajectories.turn == 1]
                                    .head(len(tasks) * args.rollouts).sort_values(["task_id", "sample"])
                                    .response_token_ids],
                }
                print(f"rl.async {label}: {json.dumps(runs[label]['steps'], default=str)}", flush=True)
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
    # the overlap must not change what is sampled: step 1's first turns are equal in every mode
    same_first_turn = len({tuple(run.pop("first_turns")) for run in runs.values()}) == 1
    report.data.update(model=args.size, settings=vars(args), timings=timings, runs=runs,
                       same_first_turn_answers=same_first_turn)
    report.line(
        f"Model: `{args.size}` (random init, {args.vocab}-token BPE, + {args.sft_steps} SFT steps on bank kernels, "
        f"final loss {sft.final_loss:.4f}); {args.steps} RL step(s) of "
        f"{len(TASKS)} prompts x {args.rollouts} rollouts x up to {args.turns} turns, {args.max_tokens} tokens per "
        f"turn, {args.generation_batch_size} sequences per generate(); KernelGym pool with the paper's protocol "
        "(eager baseline); reward Eq. 8 (PR), PRS, TRLOO, PPO-clip under bf16.", "",
        "| rl.async | step | generation s | evaluation s | training s | step wall s | overlap saved s | policy lag "
        "| turns | mean reward |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *[f"| {mode} | {step} | {v['gen_s']:.1f} | {v['eval_s']:.1f} | {v['train_s']:.1f} | {v['step_s']:.1f} | "
          f"{v['overlap_s']:.1f} | {v['policy_lag']:.0f} | {v['rows']:.0f} | {v['reward_mean']:.3f} |"
          for mode, run in runs.items() for step, v in run["steps"].items()], "",
        f"First turn's answers identical across modes: {same_first_turn}. Statuses: "
        + "; ".join(f"{mode} {run['statuses']}" for mode, run in runs.items()) + ".",
        "Iteration wall times (model load, steps, checkpoint export): "
        + ", ".join(f"{mode} {run['iteration_s']:.0f} s" for mode, run in runs.items()) + ".",
    )
    report.expect(same_first_turn, "step 1's first turns differ between rl.async modes")


SECTIONS = (Section("step", 240, rl_step),)
