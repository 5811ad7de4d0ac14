"""What a run costs before it runs: GPU-hours per stage, the critical path and the wall time on N GPUs of
a kind (issue 54). Pure arithmetic on a merged config and the units of config/cost_units.yaml, one named
function per formula so each can be checked by hand; docs/cost.md explains the model and its sources."""

from __future__ import annotations

import math
from collections.abc import Callable
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
class Architecture:
    """The shapes beyond the parameter count that attention FLOPs and the KV cache depend on."""

    layers: int
    attention_width: int  # query heads x head dim
    kv_width: int  # key-value heads x head dim


@dataclass(frozen=True)
class Units:
    figures: dict[str, Figure]
    gpu_kinds: dict[str, dict[str, Figure]]
    models: dict[str, Figure]
    # shapes of models that are no preset of kpipe.train.tiny_model (the tests' round numbers)
    architectures: dict[str, Architecture] = field(default_factory=dict)

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

def architecture_of(model: str, units: Units) -> Architecture:
    """A hub model's shapes: the kpipe.train.tiny_model preset that copies it (one source of truth)."""
    from kpipe.train.tiny_model import PRESET_HUB_MODELS, SIZE_PRESETS

    if model in units.architectures:
        return units.architectures[model]
    preset = next((SIZE_PRESETS[size] for size, hub in PRESET_HUB_MODELS.items() if hub == model), None)
    if preset is None:
        raise ValueError(f"no architecture for {model!r}: add its preset to kpipe.train.tiny_model (PRESET_HUB_MODELS)")
    return Architecture(preset["num_hidden_layers"], preset["num_attention_heads"] * preset["head_dim"],
                        preset["num_key_value_heads"] * preset["head_dim"])


def flops_per_token(params: float, layers: int, attention_width: int, sequence_tokens: float,
                    passes: int = 3) -> float:
    """FLOPs a token of a causal sequence: 2 per parameter plus attention, 2 L d S (QK^T and AV are 4 d a
    query-key pair, the mask halves the S keys), a pass; a forward is 1 pass, forward + backward 3."""
    return passes * (FLOPS_PER_PARAM_FORWARD * params + 2.0 * layers * attention_width * sequence_tokens)


def prefill_tokens_per_s(peak_flops: float, mfu: float, params: float) -> float:
    """Prefill is compute-bound: 2 FLOPs per parameter and token at a fraction of the peak."""
    return peak_flops * mfu / (FLOPS_PER_PARAM_FORWARD * params)


def kv_bytes_per_token(layers: int, kv_width: int, bytes_per_value: float = 2) -> float:
    """The KV cache of one token: a key and a value of kv_width per layer (bf16)."""
    return 2 * layers * kv_width * bytes_per_value


def kv_capacity_tokens(gpu_memory_bytes: float, engine_memory_fraction: float, engine_weight_bytes: float,
                       kv_bytes: float) -> float:
    """Tokens the engine's KV cache holds: its share of the GPU (vLLM's gpu_memory_utilization, a budget for
    its own memory whatever else the GPU holds), less its weights. vLLM also keeps its peak activations out
    of the share (1.5 GiB for the 8B at 16,384 batched tokens on an H100, the one-GPU smoke's log): left out."""
    return max(0.0, gpu_memory_bytes * engine_memory_fraction - engine_weight_bytes) / kv_bytes


def rl_engine_memory_fraction(rl: dict[str, Any]) -> float | None:
    """The share of its GPU RL's colocated vLLM engine takes (`rl.vllm_gpu_memory_utilization`, RLConfig's default
    where unset); None for the HF engine."""
    if rl.get("engine") != "vllm":
        return None
    from kpipe.train.rl_config import RLConfig  # torch comes with it: only for a vLLM run's plan

    return float(rl.get("vllm_gpu_memory_utilization", RLConfig.vllm_gpu_memory_utilization))


def check_engine_beside_trainer(gpu_memory_bytes: float, engine_memory_fraction: float,
                                trainer_resident_bytes: float) -> None:
    """Refuse a colocated engine whose share does not fit beside what the trainer keeps on the GPU while the
    engine decodes: vLLM 0.26.0 refuses to start unless that much of the GPU is free."""
    if gpu_memory_bytes * engine_memory_fraction + trainer_resident_bytes > gpu_memory_bytes:
        raise ValueError(f"rl.vllm_gpu_memory_utilization {engine_memory_fraction} asks "
                         f"{gpu_memory_bytes * engine_memory_fraction / 2**30:.0f} GiB of a "
                         f"{gpu_memory_bytes / 2**30:.0f} GiB GPU beside the trainer's "
                         f"{trainer_resident_bytes / 2**30:.0f} GiB: lower it, or give RL more GPUs")


def mean_decode_context(turns: int, answer_tokens: float, prompt_tokens: float, feedback_tokens: float) -> float:
    """The mean context a decoded token attends to over a trajectory's turns: turn t starts after the prompt
    and t-1 answers and feedbacks, and its answer attends to half of itself on average."""
    return sum(prompt_tokens + t * (answer_tokens + feedback_tokens) + answer_tokens / 2 for t in range(turns)) / turns


def decode_batch(sequences: float, max_sequences: float, kv_capacity: float, context: float) -> float:
    """Sequences decoding at once: those there are, up to the engine's limit and what the KV cache holds."""
    return max(1.0, min(sequences, max_sequences, math.floor(kv_capacity / context)))


def decode_step_seconds(batch: float, context: float, weight_bytes: float, kv_bytes: float, hbm_bytes_per_s: float,
                        bandwidth_efficiency: float, params: float, peak_flops: float, mfu: float) -> float:
    """One decode step: every weight and every sequence's KV cache read once at a fraction of the bandwidth,
    unless the batch's 2 FLOPs per parameter and token take longer."""
    read = (weight_bytes + batch * context * kv_bytes) / (hbm_bytes_per_s * bandwidth_efficiency)
    compute = batch * FLOPS_PER_PARAM_FORWARD * params / (peak_flops * mfu)
    return max(read, compute)


def decode_tokens_per_s(batch: float, step_seconds: float) -> float:
    return batch / step_seconds


def implied_bandwidth_efficiency(tokens_per_s: float, batch: float, context: float, weight_bytes: float,
                                 kv_bytes: float, hbm_bytes_per_s: float) -> float:
    """`decode_step_seconds` read backwards: the fraction of the bandwidth at which a measured decode rate reads
    every weight and every sequence's KV cache once a step (the unit decode_bandwidth_efficiency;
    checks/gpu/paper_units.py's vllm_replay measures it)."""
    return (weight_bytes + batch * context * kv_bytes) / hbm_bytes_per_s / (batch / tokens_per_s)


def longest_answer_floor_seconds(turns: int, max_tokens: int, prompt_tokens: float, feedback_tokens: float,
                                 step_seconds_at: Callable[[float], float]) -> float:
    """No step ends before its longest trajectory: every turn's answer fills max_tokens, decoded one token a
    step at low batch (`step_seconds_at(context)` of a batch of one)."""
    return sum(max_tokens * step_seconds_at(prompt_tokens + t * (max_tokens + feedback_tokens) + max_tokens / 2)
               for t in range(turns))


def rollout_gpu_seconds(prefill_tokens: float, decode_tokens: float, prefill_rate: float, decode_rate: float) -> float:
    """GPU-seconds of engine replicas of one GPU each, at per-replica rates."""
    return prefill_tokens / prefill_rate + decode_tokens / decode_rate


def training_gpu_seconds(tokens: float, flops_a_token: float, peak_flops: float, mfu: float) -> float:
    return tokens * flops_a_token / (peak_flops * mfu)


def kernelgym_gpu_seconds(evaluations: float, evaluations_per_min_per_gpu: float) -> float:
    return evaluations * 60.0 / evaluations_per_min_per_gpu


def weight_sync_seconds(params: float, bytes_per_param: float, bytes_per_s: float) -> float:
    """One push of the trainer's weights into its colocated vLLM engine."""
    return params * bytes_per_param / bytes_per_s


def optimizer_step_seconds(params: float, gpus: int, host_bytes_per_param: float, copy_bytes_per_s: float) -> float:
    """An offloaded AdamW step: each GPU streams its shard's host state in and out over its own link (a
    plan with nothing on the host steps on the GPU in a negligible time)."""
    return 2 * params * host_bytes_per_param / gpus / copy_bytes_per_s


def host_memory_needed(params: float, host_bytes_per_param: float, overhead_bytes: float) -> float:
    """The host memory a training job needs: the offloaded optimizer state and the processes beside it."""
    return params * host_bytes_per_param + overhead_bytes


@dataclass(frozen=True)
class DiskSizes:
    """Bytes a parameter of what the training jobs write: a trainer checkpoint (HF, fp32), an evaluation-only
    export and a built base (HF, bf16), an optimizer state (accelerate's model and AdamW's moments)."""

    checkpoint: float
    export: float
    state: float


def sft_disk_bytes_per_param(base: float, checkpoints_in_flight: int, sizes: DiskSizes) -> float:
    """While SFT runs: its base, its model export and its unfinished checkpoints (each a model and a state)."""
    return base + sizes.checkpoint + checkpoints_in_flight * (sizes.checkpoint + sizes.state)


def rl_disk_bytes_per_param(iterations: int, steps_per_iteration: int, runs: int, concurrent: int,
                            final_checkpoint: str, keep_states: bool, sizes: DiskSizes,
                            step_checkpoints: bool = True) -> float:
    """The most RL's iterations hold at once, beside the SFT model, as kpipe.train.rl and rules/rl.smk write them:
    every iteration's model is kept (rl_validate and best_val read them), fp32 but the last under
    `final_checkpoint: evaluation` (bf16); an iteration reads the state before it and writes its own (none for that
    last one), the older dropped unless `keep_states`; with several steps and `step_checkpoints` an iteration keeps a
    scratch checkpoint (a model and a state) and writes the next before pruning it. `concurrent` runs go side by side at the same
    iteration, after the runs before them finished (keeping their models and last state)."""
    evaluation = final_checkpoint == "evaluation"
    models = [sizes.checkpoint] * (iterations - 1) + [sizes.export if evaluation else sizes.checkpoint]
    states = [sizes.state] * (iterations - 1) + [0.0 if evaluation else sizes.state]
    scratch = sizes.checkpoint + sizes.state if steps_per_iteration > 1 and step_checkpoints else 0.0
    finished = sum(models) + (sum(states) if keep_states else states[-1])
    peak = 0.0
    for k in range(iterations):
        before = sum(models[:k]) + (sum(states[:k]) if keep_states else states[k - 1] if k else 0.0)
        peak = max(peak, before + max(2 * scratch, scratch + models[k] + states[k]))
    return (runs - concurrent) * finished + concurrent * peak


def disk_needed(params: float, bytes_per_param: float, overhead_bytes: float) -> float:
    """The disk a run fills at its fullest: its checkpoints' bytes a parameter, and the environment beside them."""
    return params * bytes_per_param + overhead_bytes


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


def turn_row_tokens(turns: int, max_tokens: int, response_fill: float, prompt_tokens: float,
                    feedback_tokens: float) -> list[float]:
    """Tokens of each turn's training row: RL trains one row a turn, its whole context plus its answer
    (kpipe.train.samples, unit "turn"), so a trajectory's later turns are trained again with every earlier one."""
    answer = max_tokens * response_fill
    return [prompt_tokens + turn * (answer + feedback_tokens) + answer for turn in range(turns)]


def rl_update_passes(rl: dict[str, Any]) -> int:
    """The update's passes over a row it trains: a forward and backward (3 passes) each PPO epoch. Every row
    is read once more before, by the old policy's log-prob forward (MRS and PRS then drop some)."""
    return 3 * rl.get("ppo_epochs", 1)


def rl_rows_train_seconds(config: dict[str, Any], units: Units, kind: str, row_tokens: float, rows: float,
                          trained_row_tokens: float | None = None, trained_rows: float | None = None) -> float:
    """The plan's forward and backward seconds (one GPU) for the rows a run did read: the log-prob forward
    over every row (`row_tokens` over `rows`), the update's forward and backward over the rows it trained
    (`trained_row_tokens` over `trained_rows`, every row where not given; MRS and PRS drop the others before
    the update), each at the trainer's FLOPs a token for its mean length and the measured MFU. The trainer's
    units alone, without the plan's guesses of a prompt's, an answer's and a feedback's tokens; a mean length
    counts a little less attention than the rows' own lengths would."""
    base_model = policy_architecture(config)
    shapes = architecture_of(base_model, units)
    peak = units.gpu_kinds[kind]["peak_bf16_flops"].value

    def seconds(tokens: float, count: float, passes: int) -> float:
        if tokens <= 0 or count <= 0:
            return 0.0
        flops = flops_per_token(units.models[base_model].value, shapes.layers, shapes.attention_width,
                                tokens / count, passes)
        return training_gpu_seconds(tokens, flops, peak, units["training_mfu"])

    if trained_row_tokens is None or trained_rows is None:
        trained_row_tokens, trained_rows = row_tokens, rows
    return seconds(row_tokens, rows, 1) + seconds(trained_row_tokens, trained_rows, rl_update_passes(config["rl"]))


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
    # an RL step's predicted seconds by phase, named as the run's train_metrics name them (rollout_s, optimizer_s, ...)
    phases: dict[str, float] = field(default_factory=dict)

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


def plan_cost(config: dict[str, Any], units: Units, gpus: int, kind: str, gym_gpus: int = 0,
              host_memory_bytes: float | None = None, disk_bytes: float | None = None) -> CostPlan:
    """GPU-hours and wall time of each stage of a validated, merged config on `gpus` GPUs of `kind`, `gym_gpus`
    of them judging kernels only (0: KernelGym shares the jobs' GPUs). Refuses a machine whose host memory or
    disk (default: the kind's figures per GPU) the run does not fit."""
    from kpipe.train.sft import PRESETS
    from kpipe.train.trainer_memory import candidate_plans, choose_memory_plan, read_offload_setting

    if kind not in units.gpu_kinds:
        raise ValueError(f"unknown GPU kind {kind!r} (known: {', '.join(sorted(units.gpu_kinds))})")
    if gpus < 1:
        raise ValueError("--gpus must be at least 1")
    if not 0 <= gym_gpus < gpus:
        raise ValueError(f"--gym-gpus must leave a GPU to train and decode on: {gym_gpus} of {gpus}")
    base_model = policy_architecture(config)
    if base_model not in units.models:
        raise ValueError(f"no parameter count for policy.base_model {base_model!r} in the units file's models")
    params = units.models[base_model].value
    shapes = architecture_of(base_model, units)
    gpu = units.gpu_kinds[kind]
    peak, bandwidth, gpu_memory = (gpu[name].value for name in ("peak_bf16_flops", "hbm_bytes_per_s", "memory_bytes"))
    weight_bytes = params * units["bytes_per_parameter"]
    kv_bytes = kv_bytes_per_token(shapes.layers, shapes.kv_width, units["bytes_per_parameter"])
    prefill_rate = prefill_tokens_per_s(peak, units["prefill_mfu"], params)
    gym_rate = units["kernelgym_evaluations_per_min_per_gpu"]
    compute_gpus = gpus - gym_gpus  # the GPUs that train and decode
    gym_where = f"on {gym_gpus} GPU(s) of its own" if gym_gpus else "on the jobs' GPUs, serialised with decoding"
    notes: list[str] = []

    def job_gpus(name: str, wanted: int) -> int:
        if wanted > compute_gpus:
            notes.append(f"{name}: {wanted} GPUs asked, {compute_gpus} available: planned on {compute_gpus} "
                         f"(lower {name}.gpus)")
        return min(wanted, compute_gpus)

    def trajectory(turns: int, max_tokens: int) -> tuple[float, float, float]:
        return trajectory_tokens(turns, max_tokens, units["response_fill"], units["prompt_tokens"],
                                 units["feedback_tokens"])

    def step_seconds(batch: float, context: float) -> float:
        return decode_step_seconds(batch, context, weight_bytes, kv_bytes, bandwidth,
                                   units["decode_bandwidth_efficiency"], params, peak, units["prefill_mfu"])

    def trainer_flops(sequence: float, passes: int) -> float:
        return flops_per_token(params, shapes.layers, shapes.attention_width, sequence, passes)

    @dataclass
    class Generation:
        rollout: float  # engine GPU-seconds
        gym: float  # KernelGym GPU-seconds
        floor: float  # the longest trajectory's decoding, seconds
        batch: float
        kv_capacity: float
        decode_rate: float

        def wall(self, replicas: int, overlapped: bool) -> float:
            """Rollouts no faster than their longest answer; KernelGym beside them on GPUs of its own (under
            rl.async eval), else after them: judged on the GPU that decodes, its timings would drift."""
            rollout_wall = max(self.rollout / replicas, self.floor)
            gym_wall = self.gym / (gym_gpus or replicas)
            return max(rollout_wall, gym_wall) if overlapped and gym_gpus else rollout_wall + gym_wall

    def generation(n_trajectories: float, turns: int, max_tokens: int, replicas: int,
                   engine_fraction: float | None = None) -> Generation:
        """n trajectories on `replicas` one-GPU engines, each with `engine_fraction` of its GPU (a standalone
        engine's, `vllm_gpu_memory_fraction`, where not given)."""
        prefill, decode, _ = trajectory(turns, max_tokens)
        context = mean_decode_context(turns, max_tokens * units["response_fill"], units["prompt_tokens"],
                                      units["feedback_tokens"])
        share = units["vllm_gpu_memory_fraction"] if engine_fraction is None else engine_fraction
        capacity = kv_capacity_tokens(gpu_memory, share, weight_bytes, kv_bytes)
        batch = decode_batch(n_trajectories / replicas, units["decode_max_sequences"], capacity, context)
        rate = decode_tokens_per_s(batch, step_seconds(batch, context))
        floor = longest_answer_floor_seconds(turns, max_tokens, units["prompt_tokens"], units["feedback_tokens"],
                                             lambda at: step_seconds(1, at))
        return Generation(rollout_gpu_seconds(n_trajectories * prefill, n_trajectories * decode, prefill_rate, rate),
                          kernelgym_gpu_seconds(n_trajectories * turns, gym_rate), floor, batch, capacity, rate)

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
    sft_batch = sft.get("batch_size", units["sft_batch_size"])
    if sft.get("max_steps"):
        sft_samples = min(sft_samples, sft["max_steps"] * sft_batch)
    sft_gpus = job_gpus("sft", sft["gpus"])
    sft_memory = choose_memory_plan(params, sft_gpus, gpu_memory, candidate_plans(
        read_offload_setting(sft).get("optimizer_offload", "off")))
    sft_optimizer = math.ceil(sft_samples / sft_batch) * optimizer_step_seconds(
        params, sft_gpus, sft_memory.host_bytes_per_param, units["host_copy_bytes_per_s"])
    sft_gpu = (training_gpu_seconds(sft_samples * sft_sequence, trainer_flops(sft_sequence, 3), peak,
                                    units["training_mfu"]) + sft_optimizer * sft_gpus)
    sft_wall = job_wall_seconds(sft_gpu, sft_gpus, units["trainer_startup_s"])
    stages.append(Stage("sft", sft_gpu, sft_wall, True,
                        f"{sft_samples:.0f} samples of {sft_sequence:.0f} tokens on {sft_gpus} GPUs, memory plan "
                        f"{sft_memory.name} ({sft_optimizer:.0f} s of optimizer steps)",
                        [f"benchmarks/sft-{config['run']}.tsv"], sft_wall))

    rl = config["rl"]
    run_names = [*([config["run"]] if rl.get("base_run", True) else []), *(rl.get("runs") or {})]
    runs = len(run_names)
    rl_gpus = job_gpus("rl", rl["gpus"])
    rl_memory = choose_memory_plan(params, rl_gpus, gpu_memory, candidate_plans(
        read_offload_setting(rl).get("optimizer_offload", "off")))
    step_trajectories = rl["prompts_per_step"] * rl["rollouts_per_prompt"]
    # the colocated engine's share is the run's own setting, beside what the trainer keeps while it decodes
    rl_engine_fraction = rl_engine_memory_fraction(rl)
    if rl_engine_fraction is not None:
        check_engine_beside_trainer(gpu_memory, rl_engine_fraction, params * rl_memory.resident_bytes_per_param / rl_gpus)
    rl_generation = generation(step_trajectories, rl["max_turns"], rl["max_tokens"], rl_gpus, rl_engine_fraction)
    _, _, rl_sequence = trajectory(rl["max_turns"], rl["max_tokens"])
    rl_rows = turn_row_tokens(rl["max_turns"], rl["max_tokens"], units["response_fill"], units["prompt_tokens"],
                              units["feedback_tokens"])
    # the update recomputes the old policy's log-probs (one forward) before its forward and backward
    train = sum(training_gpu_seconds(step_trajectories * row, trainer_flops(row, 1 + rl_update_passes(rl)), peak,
                                     units["training_mfu"]) for row in rl_rows)
    optimizer = rl.get("mini_batches", 1) * rl.get("ppo_epochs", 1) * optimizer_step_seconds(
        params, rl_gpus, rl_memory.host_bytes_per_param, units["host_copy_bytes_per_s"])
    sync = weight_sync_seconds(params, units["bytes_per_parameter"], units["weight_sync_bytes_per_s"])
    overlapped = rl.get("async", "off") == "eval"
    step_wall = (rl_generation.wall(rl_gpus, overlapped) + train / rl_gpus + optimizer + sync
                 + units["sleep_wake_s"])
    iteration_startup = units["trainer_startup_s"] + units["vllm_startup_s"]
    iteration_wall = rl["steps_per_iteration"] * step_wall + iteration_startup
    steps = rl["iterations"] * rl["steps_per_iteration"]
    parallel_runs = max(1, compute_gpus // rl_gpus)
    rl_wall = math.ceil(runs / parallel_runs) * rl["iterations"] * iteration_wall
    # the run's GPUs are held for the whole iteration; GPUs of KernelGym's own count what it judges
    rl_gpu = runs * rl["iterations"] * iteration_wall * rl_gpus + (runs * steps * rl_generation.gym if gym_gpus else 0)
    stages.append(Stage("rl", rl_gpu, rl_wall, True,
                        f"{runs} run(s) x {steps} steps of {step_trajectories} trajectories x {rl['max_turns']} "
                        f"turns on {rl_gpus} GPUs ({step_wall:.0f} s a step, async {rl.get('async', 'off')}, "
                        f"KernelGym {gym_where}), memory plan {rl_memory.name}: decode batch "
                        f"{rl_generation.batch:.0f} ({rl_generation.decode_rate:.0f} tokens/s a GPU, KV cache "
                        f"{rl_generation.kv_capacity / 1e3:.0f}K tokens), longest answer {rl_generation.floor:.0f} s, "
                        f"optimizer {optimizer:.1f} s, push {sync:.2g} s, sleep/wake {units['sleep_wake_s']:.2g} s",
                        [f"benchmarks/rl-{config['run']}/{run}-iter{k}.tsv" for run in run_names
                         for k in range(rl["iterations"])],
                        runs * rl["iterations"] * iteration_wall,
                        {"rollout_s": rl_generation.wall(rl_gpus, overlapped), "forward_backward_s": train / rl_gpus,
                         "optimizer_s": optimizer, "push_s": sync, "sleep_wake_s": units["sleep_wake_s"],
                         "step_s": step_wall}))

    validation = rl["validation"]
    if validation["every"]:
        validated_iterations = [k for k in range(rl["iterations"])
                                if k % validation["every"] == validation["every"] - 1 or k == rl["iterations"] - 1]
        validated = len(validated_iterations)
        val_trajectories = _tasks(config, [validation["level"]], validation["max_tasks"]) * validation["samples"]
        val = generation(val_trajectories, validation["turns"], validation["sampling"]["max_tokens"], rl_gpus)
        validations = runs * validated
        val_gpu = validations * (val.rollout + val.gym)
        val_last = val.wall(rl_gpus, overlapped) + units["vllm_startup_s"]
        spare = compute_gpus - min(runs, parallel_runs) * rl_gpus
        if spare >= 1:  # GPUs the RL iterations leave free validate the finished iterations meanwhile
            val_wall = val_last + max(0.0, val_gpu / spare - rl_wall)
            overlap = f"on the {spare} GPU(s) the iterations leave free, the last after it"
        else:  # every GPU is training: each validation waits for one
            val_wall = validations * val_last * rl_gpus / compute_gpus
            overlap = "between iterations, on every GPU"
        stages.append(Stage("rl_validate", val_gpu, val_wall, True,
                            f"{validations} validations of {val_trajectories} trajectories x "
                            f"{validation['turns']} turns, {overlap}",
                            [f"benchmarks/rl_val-{config['run']}/{run}-iter{k}.tsv" for run in run_names
                             for k in validated_iterations],
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
        stage_generation = generation(trajectories * len(costed), turns, section["sampling"]["max_tokens"],
                                      compute_gpus)
        stage_gpu = stage_generation.rollout + stage_generation.gym
        note = f"{len(costed)} pipeline model(s) x {trajectories} trajectories x {turns} turns"
        if skipped:
            note += f"; not costed (API or served checkpoints): {', '.join(skipped)}"
        stages.append(Stage(stage_name, stage_gpu, stage_generation.wall(compute_gpus, True) + units["vllm_startup_s"],
                            True, note))
    # eval and stts run side by side after checkpoint selection: the longer of the two is on the critical path
    eval_stage, stts_stage = (next((s for s in stages if s.name == name), None) for name in ("eval", "stts"))
    if eval_stage and stts_stage:
        eval_stage.critical = eval_stage.wall_s >= stts_stage.wall_s
        stts_stage.critical = not eval_stage.critical
        if gpus > 1:  # side by side they share the GPUs: their wall is at least their GPU-seconds over all
            longest = eval_stage if eval_stage.critical else stts_stage
            longest.wall_s = max(longest.wall_s, (eval_stage.gpu_seconds + stts_stage.gpu_seconds) / gpus)

    # the machine: host memory for the offloaded optimizer state, disk for what the run keeps
    host_have = host_memory_bytes if host_memory_bytes is not None else gpu["host_memory_bytes_per_gpu"].value * gpus
    disk_have = disk_bytes if disk_bytes is not None else gpu["disk_bytes_per_gpu"].value * gpus
    host_bytes_per_param = max(sft_memory.host_bytes_per_param, rl_memory.host_bytes_per_param)
    host_need = host_memory_needed(params, host_bytes_per_param, units["host_memory_overhead_bytes"])
    sizes = DiskSizes(units["checkpoint_bytes_per_parameter"], units["bytes_per_parameter"],
                      units["optimizer_state_bytes_per_parameter"])
    # the base: a hub model's bf16 copy stays; a real-size preset built here (bf16) is deleted once SFT has run
    built_base = config["policy"]["base_model"] == "tiny"
    sft_preset = PRESETS[sft["preset"]] if sft.get("preset") else None
    save_every = sft.get("save_every", sft_preset.save_every if sft_preset else 0)
    keep_last = sft.get("keep_last", sft_preset.keep_last if sft_preset else 2)
    sft_saves = (math.ceil(sft_samples / sft_batch) - 1) // save_every if save_every else 0
    sft_disk = sft_disk_bytes_per_param(sizes.export, min(sft_saves, keep_last + 1), sizes)
    final_checkpoint = rl.get("final_checkpoint", "trainer")
    rl_disk = (sizes.checkpoint + (0.0 if built_base else sizes.export)
               + rl_disk_bytes_per_param(rl["iterations"], rl["steps_per_iteration"], runs, min(runs, parallel_runs),
                                         final_checkpoint, bool(rl.get("keep_optimizer_states")), sizes,
                                         rl.get("step_checkpoints", True)))
    disk_need = disk_needed(params, max(sft_disk, rl_disk), units["disk_overhead_bytes"])
    disk_what = (f"at its fullest {'during SFT' if sft_disk > rl_disk else 'during RL'}: {max(sft_disk, rl_disk):.0f} "
                 f"bytes a parameter; RL's last iteration keeps "
                 f"{'a bf16 model and no optimizer state' if final_checkpoint == 'evaluation' else 'a trainer checkpoint'}")
    if host_need > host_have or disk_need > disk_have:
        raise ValueError(
            f"the run does not fit {gpus} x {kind.upper()}: it needs {host_need / 2**30:,.0f} GiB of host memory "
            f"(has {host_have / 2**30:,.0f}; {host_bytes_per_param} bytes a parameter offloaded) and "
            f"{disk_need / 2**30:,.0f} GiB of disk (has {disk_have / 2**30:,.0f}; {disk_what}): pass "
            "--host-memory-gib/--disk-gib for a larger machine")
    notes.append(f"machine: {host_need / 2**30:,.0f} of {host_have / 2**30:,.0f} GiB host memory (memory plans: sft "
                 f"{sft_memory.name}, rl {rl_memory.name}), {disk_need / 2**30:,.0f} of {disk_have / 2**30:,.0f} GiB "
                 f"disk ({disk_what})")

    used = {"training_mfu", "prefill_mfu", "decode_bandwidth_efficiency", "decode_max_sequences",
            "vllm_gpu_memory_fraction", "decode_tokens_per_s_0_6b", "kernelgym_evaluations_per_min_per_gpu",
            "weight_sync_bytes_per_s", "bytes_per_parameter", "vllm_startup_s", "trainer_startup_s",
            "prompt_tokens", "feedback_tokens", "response_fill", "sft_batch_size", "host_copy_bytes_per_s",
            "sleep_wake_s", "host_memory_overhead_bytes", "checkpoint_bytes_per_parameter",
            "optimizer_state_bytes_per_parameter", "disk_overhead_bytes"}
    assumptions = [*gpu.values(), units.models[base_model], *(units.figures[name] for name in sorted(used))]
    scaled = units["decode_tokens_per_s_0_6b"] * 0.596e9 / params
    notes.append(f"decode: {rl_generation.decode_rate:.0f} tokens/s per GPU at RL's batch of "
                 f"{rl_generation.batch:.0f} and {kv_bytes / 1024:.0f} KiB of KV a token; "
                 f"{1 / step_seconds(1, units['prompt_tokens']):.0f} tokens/s at batch 1; the 0.6B measurement "
                 f"scaled by parameters gives {scaled:.0f} (cross-check, not used)")
    notes.append(f"prefill: {prefill_rate:.0f} tokens/s per GPU estimated (compute bound)")
    notes.append(f"training: {trainer_flops(rl_sequence, 3) / 1e9:.0f} GFLOP a token at RL's {rl_sequence:.0f}-token "
                 f"trajectories, {6 * params / 1e9:.0f} of them 6P (attention {trainer_flops(rl_sequence, 3) / (6 * params) - 1:.0%} more); "
                 f"RL trains a row a turn: {sum(rl_rows):.0f} tokens a trajectory")
    notes.append("not modelled: CPU stages (ingest, tables), the teacher's API time, checkpoint writes, "
                 "preemption when the KV cache overflows")
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


def measured_job_seconds(logs: Path, benchmarks: list[str]) -> float | None:
    """The sum of the jobs' wall seconds that Snakemake's `benchmark:` files recorded (column `s`).

    None when the stage did not run under `logs` (a run stopped with `--until`); an error when only
    some of its jobs did, since a part of a stage's time compared with all of it would mislead.
    """
    paths = [logs / name for name in benchmarks]
    missing = [path for path in paths if not path.is_file()]
    if len(missing) == len(paths):
        return None
    if missing:
        raise ValueError(f"no benchmark {missing[0]}: did the run of this config finish under {logs}?")
    total = 0.0
    for path in paths:
        header, first = path.read_text().splitlines()[:2]
        total += float(dict(zip(header.split("\t"), first.split("\t")))["s"])
    return total


def format_comparison(plan: CostPlan, logs: Path, tolerance: float = 0.25) -> str:
    """Predicted against measured seconds of each timed stage (issue 54: within 25 %)."""
    lines = [f"{'stage':<12} {'predicted s':>12} {'measured s':>11} {'ratio':>6}  within {tolerance:.0%}"]
    timed = [stage for stage in plan.stages if stage.benchmarks]
    seconds = [measured_job_seconds(logs, stage.benchmarks) for stage in timed]
    if timed and all(measured is None for measured in seconds):
        raise ValueError(f"no benchmark {logs / timed[0].benchmarks[0]}: did a run of this config write its logs "
                         f"under {logs}?")
    for stage, measured in zip(timed, seconds):
        if measured is None:
            lines.append(f"{stage.name:<12} {stage.job_seconds:>12.0f} {'not run':>11}")
            continue
        ratio = stage.job_seconds / measured
        lines.append(f"{stage.name:<12} {stage.job_seconds:>12.0f} {measured:>11.0f} {ratio:>6.2f}  "
                     f"{'yes' if abs(ratio - 1) <= tolerance else 'NO'}")
    return "\n".join(lines)
