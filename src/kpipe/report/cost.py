"""What a run costs before it runs: GPU-hours per stage, the critical path and the wall time on N GPUs of
a kind (issue 54). Pure arithmetic on a merged config and the units of config/cost_units.yaml, one named
function per formula so each can be checked by hand; docs/cost.md explains the model and its sources."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kpipe.data.kernelbench import load_problems

FLOPS_PER_PARAM_TRAINED = 6  # forward 2 + backward 4 per parameter and token
FLOPS_PER_PARAM_FORWARD = 2
# the paper's own compute statement, beside the model's totals (docs/cost.md)
PAPER_COMPUTE = ("the paper reports its hardware (NVIDIA H100, §6.1) but no GPU-hours, GPU count or wall time "
                 "(its released code was not read here)")


@dataclass(frozen=True)
class Figure:
    """One unit of the cost model, with where its value comes from."""

    name: str
    value: float
    unit: str
    source: str  # measured | estimated
    why: str
    report: str | None = None


@dataclass(frozen=True)
class Units:
    figures: dict[str, Figure]
    gpu_kinds: dict[str, dict[str, Figure]]
    models: dict[str, Figure]

    def __getitem__(self, name: str) -> float:
        return self.figures[name].value


def _figure(name: str, entry: dict[str, Any]) -> Figure:
    missing = {"value", "unit", "source", "why"} - set(entry)
    if missing:
        raise ValueError(f"cost units: {name} lacks {sorted(missing)}")
    if entry["source"] not in ("measured", "estimated"):
        raise ValueError(f"cost units: {name}: source must be measured or estimated, not {entry['source']!r}")
    if entry["source"] == "measured" and not entry.get("report"):
        raise ValueError(f"cost units: {name} is measured but names no report")
    return Figure(name, float(entry["value"]), str(entry["unit"]), entry["source"], str(entry["why"]),
                  entry.get("report"))


def load_units(path: str | Path) -> Units:
    data = yaml.safe_load(Path(path).read_text())
    return Units(
        figures={name: _figure(name, entry) for name, entry in data["units"].items()},
        gpu_kinds={kind: {name: _figure(f"{kind}.{name}", entry) for name, entry in figures.items()}
                   for kind, figures in data["gpu_kinds"].items()},
        models={name: _figure(name, entry) for name, entry in data["models"].items()},
    )


# --- the formulas ---------------------------------------------------------------------------------------

def prefill_tokens_per_s(peak_flops: float, mfu: float, params: float) -> float:
    """Prefill is compute-bound: 2 FLOPs per parameter and token at a fraction of the peak."""
    return peak_flops * mfu / (FLOPS_PER_PARAM_FORWARD * params)


def decode_tokens_per_s(hbm_bytes_per_s: float, params: float, bytes_per_param: float, concurrency: float,
                        batch_efficiency: float) -> float:
    """Decode is bandwidth-bound: each step reads every weight once and yields one token per sequence."""
    return hbm_bytes_per_s / (params * bytes_per_param) * concurrency * batch_efficiency


def rollout_gpu_seconds(prefill_tokens: float, decode_tokens: float, prefill_rate: float, decode_rate: float) -> float:
    """GPU-seconds of engine replicas of one GPU each, at per-replica rates."""
    return prefill_tokens / prefill_rate + decode_tokens / decode_rate


def training_gpu_seconds(tokens: float, params: float, peak_flops: float, mfu: float,
                         flops_per_param: float = FLOPS_PER_PARAM_TRAINED) -> float:
    return tokens * flops_per_param * params / (peak_flops * mfu)


def kernelgym_gpu_seconds(evaluations: float, evaluations_per_min_per_gpu: float) -> float:
    return evaluations * 60.0 / evaluations_per_min_per_gpu


def weight_sync_seconds(params: float, bytes_per_param: float, bytes_per_s: float) -> float:
    """One push of the trainer's weights into its colocated vLLM engine."""
    return params * bytes_per_param / bytes_per_s


def job_wall_seconds(gpu_seconds: float, gpus: int, startup_s: float) -> float:
    """A job whose work spreads evenly over its GPUs, after its start-up (which every GPU waits through)."""
    return gpu_seconds / gpus + startup_s


def trajectory_tokens(turns: int, max_tokens: int, response_fill: float, prompt_tokens: float,
                      feedback_tokens: float) -> tuple[float, float, float]:
    """(prefill, decode, whole sequence) tokens of one multi-turn trajectory, prefix caching on: a later turn
    prefills only the feedback it adds."""
    decode = turns * max_tokens * response_fill
    prefill = prompt_tokens + (turns - 1) * feedback_tokens
    return prefill, decode, prefill + decode


# --- the plan -------------------------------------------------------------------------------------------

@dataclass
class Stage:
    name: str
    gpu_seconds: float
    wall_s: float
    critical: bool
    note: str
    # the stage's Snakemake benchmark files (under the run's logs/) and their predicted sum of seconds: set for
    # the stages whose jobs run one after another on the GPUs they ask, where a job's time is the model's
    benchmarks: list[str] = field(default_factory=list)
    job_seconds: float = 0.0

    @property
    def gpu_hours(self) -> float:
        return self.gpu_seconds / 3600.0


@dataclass
class CostPlan:
    gpus: int
    kind: str
    stages: list[Stage]
    assumptions: list[Figure]
    notes: list[str] = field(default_factory=list)

    @property
    def gpu_hours(self) -> float:
        return sum(stage.gpu_hours for stage in self.stages)

    @property
    def wall_s(self) -> float:
        return sum(stage.wall_s for stage in self.stages if stage.critical)


def _tasks(config: dict[str, Any], levels: list[int] | None, max_tasks: int | None) -> int:
    """Evaluation tasks: KernelBench's problems of the levels (kernelbench.ids kept), max_tasks per level."""
    counts: dict[int, int] = {}
    ids = config["kernelbench"].get("ids") or {}
    for problem in load_problems(config["kernelbench"]["version"]):
        if problem.level in (levels or config["kernelbench"]["levels"]) and (
                problem.level not in ids or problem.problem_id in ids[problem.level]):
            counts[problem.level] = counts.get(problem.level, 0) + 1
    return sum(min(count, max_tasks or count) for count in counts.values())


def policy_architecture(config: dict[str, Any]) -> str:
    """The hub model whose parameters price the policy: a real-size local preset (config/paper_smoke.yaml's
    qwen3-8b, random weights) costs what the model whose shapes it copies costs."""
    from kpipe.train.tiny_model import PRESET_HUB_MODELS

    policy = config["policy"]
    if policy["base_model"] == "tiny":
        return PRESET_HUB_MODELS.get(policy["tiny"]["size"], f"tiny:{policy['tiny']['size']}")
    return policy["base_model"]


def plan_cost(config: dict[str, Any], units: Units, gpus: int, kind: str) -> CostPlan:
    """GPU-hours and wall time of each stage of a validated, merged config on `gpus` GPUs of `kind`."""
    if kind not in units.gpu_kinds:
        raise ValueError(f"unknown GPU kind {kind!r} (known: {', '.join(sorted(units.gpu_kinds))})")
    if gpus < 1:
        raise ValueError("--gpus must be at least 1")
    base_model = policy_architecture(config)
    if base_model not in units.models:
        raise ValueError(f"no parameter count for policy.base_model {base_model!r} in the units file's models")
    params = units.models[base_model].value
    peak = units.gpu_kinds[kind]["peak_bf16_flops"].value
    bandwidth = units.gpu_kinds[kind]["hbm_bytes_per_s"].value
    prefill_rate = prefill_tokens_per_s(peak, units["prefill_mfu"], params)
    decode_rate = decode_tokens_per_s(bandwidth, params, units["bytes_per_parameter"], units["decode_concurrency"],
                                      units["decode_batch_efficiency"])
    gym_rate = units["kernelgym_evaluations_per_min_per_gpu"]
    notes: list[str] = []

    def job_gpus(name: str, wanted: int) -> int:
        if wanted > gpus:
            notes.append(f"{name}: {wanted} GPUs asked, {gpus} available: planned on {gpus} (lower {name}.gpus)")
        return min(wanted, gpus)

    def trajectory(turns: int, max_tokens: int) -> tuple[float, float, float]:
        return trajectory_tokens(turns, max_tokens, units["response_fill"], units["prompt_tokens"],
                                 units["feedback_tokens"])

    def generation(n_trajectories: float, turns: int, max_tokens: int) -> tuple[float, float]:
        """(rollout GPU-seconds, KernelGym GPU-seconds) of n trajectories, one evaluation a turn."""
        prefill, decode, _ = trajectory(turns, max_tokens)
        rollout = rollout_gpu_seconds(n_trajectories * prefill, n_trajectories * decode, prefill_rate, decode_rate)
        return rollout, kernelgym_gpu_seconds(n_trajectories * turns, gym_rate)

    stages: list[Stage] = []

    distill = config["distill"]
    queries = distill.get("max_queries")
    if queries is None:
        raise ValueError("distill.max_queries is null: the cost model needs the number of cold-start queries")
    distill_trajectories = queries * distill["samples"]
    distill_gym = kernelgym_gpu_seconds(distill_trajectories * distill["turns"], gym_rate)
    stages.append(Stage("distill", distill_gym, job_wall_seconds(distill_gym, gpus, 0.0), True,
                        f"{distill_trajectories} trajectories x {distill['turns']} turns judged by KernelGym; the "
                        f"teacher ({distill['teacher']}) uses no GPU of the run"))

    sft = config["sft"]
    _, _, sft_sequence = trajectory(distill["turns"], distill["sampling"]["max_tokens"])
    sft_samples = distill_trajectories * sft["epochs"]
    if sft.get("max_steps"):
        sft_samples = min(sft_samples, sft["max_steps"] * sft.get("batch_size", units["sft_batch_size"]))
    sft_gpu = training_gpu_seconds(sft_samples * sft_sequence, params, peak, units["training_mfu"])
    sft_gpus = job_gpus("sft", sft["gpus"])
    sft_wall = job_wall_seconds(sft_gpu, sft_gpus, units["trainer_startup_s"])
    stages.append(Stage("sft", sft_gpu, sft_wall, True,
                        f"{sft_samples:.0f} samples of {sft_sequence:.0f} tokens on {sft_gpus} GPUs",
                        [f"benchmarks/sft-{config['run']}.tsv"], sft_wall))

    rl = config["rl"]
    run_names = [*([config["run"]] if rl.get("base_run", True) else []), *(rl.get("runs") or {})]
    runs = len(run_names)
    rl_gpus = job_gpus("rl", rl["gpus"])
    step_trajectories = rl["prompts_per_step"] * rl["rollouts_per_prompt"]
    rollout, gym = generation(step_trajectories, rl["max_turns"], rl["max_tokens"])
    _, _, rl_sequence = trajectory(rl["max_turns"], rl["max_tokens"])
    # the update recomputes the old policy's log-probs (one forward) before its forward and backward
    train = training_gpu_seconds(step_trajectories * rl_sequence, params, peak, units["training_mfu"],
                                 FLOPS_PER_PARAM_TRAINED + FLOPS_PER_PARAM_FORWARD)
    sync = weight_sync_seconds(params, units["bytes_per_parameter"], units["weight_sync_bytes_per_s"])
    # rl.async eval judges answers while the engine decodes others: the step waits for the longer of the two
    overlapped = rl.get("async", "off") == "eval"
    generate_wall = max(rollout, gym) / rl_gpus if overlapped else (rollout + gym) / rl_gpus
    step_wall = generate_wall + train / rl_gpus + sync
    iteration_startup = units["trainer_startup_s"] + units["vllm_startup_s"]
    iteration_wall = rl["steps_per_iteration"] * step_wall + iteration_startup
    steps = rl["iterations"] * rl["steps_per_iteration"]
    rl_gpu_per_run = (steps * (rollout + gym + train + sync * rl_gpus)
                      + rl["iterations"] * iteration_startup * rl_gpus)
    parallel_runs = max(1, gpus // rl_gpus)
    rl_wall = math.ceil(runs / parallel_runs) * rl["iterations"] * iteration_wall
    stages.append(Stage("rl", runs * rl_gpu_per_run, rl_wall, True,
                        f"{runs} run(s) x {steps} steps of {step_trajectories} trajectories x {rl['max_turns']} "
                        f"turns on {rl_gpus} GPUs ({step_wall:.0f} s a step, async {rl.get('async', 'off')}), "
                        f"weights pushed every step ({sync:.1f} s)",
                        [f"benchmarks/rl-{run}-iter{k}.tsv" for run in run_names for k in range(rl["iterations"])],
                        runs * rl["iterations"] * iteration_wall))

    validation = rl["validation"]
    if validation["every"]:
        validated_iterations = [k for k in range(rl["iterations"])
                                if k % validation["every"] == validation["every"] - 1 or k == rl["iterations"] - 1]
        validated = len(validated_iterations)
        val_trajectories = _tasks(config, [validation["level"]], validation["max_tasks"]) * validation["samples"]
        val_rollout, val_gym = generation(val_trajectories, validation["turns"], validation["sampling"]["max_tokens"])
        validations = runs * validated
        val_gpu = validations * (val_rollout + val_gym)
        val_last = job_wall_seconds(val_rollout + val_gym, rl_gpus, units["vllm_startup_s"])
        spare = gpus - min(runs, parallel_runs) * rl_gpus
        if spare >= 1:  # GPUs the RL iterations leave free validate the finished iterations meanwhile
            val_wall = val_last + max(0.0, val_gpu / spare - rl_wall)
            overlap = f"on the {spare} GPU(s) the iterations leave free, the last after it"
        else:  # every GPU is training: each validation waits for one
            val_wall = val_gpu / gpus + validations * units["vllm_startup_s"]
            overlap = "between iterations, on every GPU"
        stages.append(Stage("rl_validate", val_gpu, val_wall, True,
                            f"{validations} validations of {val_trajectories} trajectories x "
                            f"{validation['turns']} turns, {overlap}",
                            [f"benchmarks/rl_val-{run}-iter{k}.tsv" for run in run_names for k in validated_iterations],
                            validations * val_last))

    policy_models = {model["name"] for model in config["models"] if model.get("kind") == "pipeline"}
    for stage_name in ("eval", "stts"):
        section = config[stage_name]
        if stage_name == "stts" and not section.get("enabled", True):
            continue
        models = section.get("models") or [model["name"] for model in config["models"]]
        costed = [name for name in models if name in policy_models]
        skipped = sorted(set(models) - policy_models)
        turns = section["max_turns"] if stage_name == "stts" else section["turns"]
        strategies = len(section.get("strategies", [None]))
        trajectories = _tasks(config, section.get("levels"), section["max_tasks"]) * section["samples"] * strategies
        stage_rollout, stage_gym = generation(trajectories * len(costed), turns, section["sampling"]["max_tokens"])
        stage_gpu = stage_rollout + stage_gym
        note = f"{len(costed)} pipeline model(s) x {trajectories} trajectories x {turns} turns"
        if skipped:
            note += f"; not costed (API or served checkpoints): {', '.join(skipped)}"
        stages.append(Stage(stage_name, stage_gpu, job_wall_seconds(stage_gpu, gpus, units["vllm_startup_s"]),
                            True, note))
    # eval and stts run side by side after checkpoint selection: the longer of the two is on the critical path
    eval_stage, stts_stage = (next((s for s in stages if s.name == name), None) for name in ("eval", "stts"))
    if eval_stage and stts_stage:
        eval_stage.critical = eval_stage.wall_s >= stts_stage.wall_s
        stts_stage.critical = not eval_stage.critical
        if gpus > 1:  # side by side they share the GPUs: their wall is at least their GPU-seconds over all
            longest = eval_stage if eval_stage.critical else stts_stage
            longest.wall_s = max(longest.wall_s, (eval_stage.gpu_seconds + stts_stage.gpu_seconds) / gpus)

    used = {"training_mfu", "prefill_mfu", "decode_concurrency", "decode_batch_efficiency",
            "decode_tokens_per_s_0_6b", "kernelgym_evaluations_per_min_per_gpu", "weight_sync_bytes_per_s",
            "bytes_per_parameter", "vllm_startup_s", "trainer_startup_s", "prompt_tokens", "feedback_tokens",
            "response_fill", "sft_batch_size"}
    assumptions = [*units.gpu_kinds[kind].values(), units.models[base_model],
                   *(units.figures[name] for name in sorted(used))]
    scaled = units["decode_tokens_per_s_0_6b"] * 0.596e9 / params
    notes.append(f"decode: {decode_rate:.0f} tokens/s per GPU estimated (bandwidth bound); the 0.6B measurement "
                 f"scaled by parameters gives {scaled:.0f} (cross-check, not used)")
    notes.append(f"prefill: {prefill_rate:.0f} tokens/s per GPU estimated (compute bound)")
    notes.append("not modelled: CPU stages (ingest, tables), the teacher's API time, KV-cache reads at long "
                 "contexts beyond decode_batch_efficiency, checkpoint writes")
    return CostPlan(gpus, kind, stages, assumptions, notes)


def format_plan(plan: CostPlan, configfiles: list[str]) -> str:
    """The command's report; its first line names every estimated unit, so no one reads it as measured."""
    estimated = [figure.name for figure in plan.assumptions if figure.source == "estimated"]
    lines = [f"ESTIMATED, NOT MEASURED: {', '.join(estimated)}",
             f"config: {' '.join(configfiles)}; {plan.gpus} x {plan.kind.upper()}", "",
             f"{'stage':<12} {'GPU-hours':>10} {'wall h':>8}  critical  what"]
    for stage in plan.stages:
        lines.append(f"{stage.name:<12} {stage.gpu_hours:>10.2f} {stage.wall_s / 3600:>8.2f}  "
                     f"{'yes' if stage.critical else 'no':<8}  {stage.note}")
    critical = " -> ".join(stage.name for stage in plan.stages if stage.critical)
    lines += ["", f"critical path: {critical}",
              f"total: {plan.gpu_hours:.1f} GPU-hours, {plan.wall_s / 3600:.1f} h wall on {plan.gpus} x "
              f"{plan.kind.upper()}",
              f"the paper: {PAPER_COMPUTE}", "", "assumptions:"]
    for figure in plan.assumptions:
        where = f"measured, {figure.report}" if figure.source == "measured" else "estimated"
        lines.append(f"  {figure.name} = {figure.value:g} {figure.unit} ({where}): {figure.why}")
    lines += ["", "notes:", *(f"  {note}" for note in plan.notes)]
    return "\n".join(lines)


def measured_job_seconds(logs: Path, benchmarks: list[str]) -> float:
    """The sum of the jobs' wall seconds that Snakemake's `benchmark:` files recorded (column `s`)."""
    total = 0.0
    for name in benchmarks:
        path = logs / name
        if not path.is_file():
            raise ValueError(f"no benchmark {path}: did the run of this config finish under {logs}?")
        header, first = path.read_text().splitlines()[:2]
        total += float(dict(zip(header.split("\t"), first.split("\t")))["s"])
    return total


def format_comparison(plan: CostPlan, logs: Path, tolerance: float = 0.25) -> str:
    """Predicted against measured seconds of each timed stage (issue 54: within 25 %)."""
    lines = [f"{'stage':<12} {'predicted s':>12} {'measured s':>11} {'ratio':>6}  within {tolerance:.0%}"]
    for stage in plan.stages:
        if not stage.benchmarks:
            continue
        measured = measured_job_seconds(logs, stage.benchmarks)
        ratio = stage.job_seconds / measured
        lines.append(f"{stage.name:<12} {stage.job_seconds:>12.0f} {measured:>11.0f} {ratio:>6.2f}  "
                     f"{'yes' if abs(ratio - 1) <= tolerance else 'NO'}")
    return "\n".join(lines)
