"""The cost model of `kpipe plan --cost` (issues 54 and 63): each formula against a hand computation, a whole plan
of a small config computed by hand, the units file's sources, the machine check, and the command's report for the
paper's runs."""

from pathlib import Path

import pytest
from click.testing import CliRunner

from kpipe.report import cost
from kpipe.report.cost import Architecture, Figure, Units
from kpipe.report.cost_cli import plan

ROOT = Path(__file__).resolve().parents[1]


def test_prefill_is_compute_bound():
    assert cost.prefill_tokens_per_s(989e12, 0.5, 8e9) == pytest.approx(989e12 * 0.5 / 16e9)  # 30,906 tokens/s


def test_training_flops_count_the_weights_and_causal_attention():
    # 3 passes x (2 x 100 + 2 x 2 layers x width 4 x 10 tokens) = 3 x (200 + 160): 6P + 6 L d S
    assert cost.flops_per_token(100, 2, 4, 10) == 1080
    assert cost.flops_per_token(100, 2, 4, 10, passes=1) == 360  # a forward only (the old policy's log-probs)
    # the 8B at 32K: attention adds 6 x 36 x 4096 x 32768 = 29 GFLOP to 6P = 49 GFLOP, 59 % more (issue 63)
    assert cost.flops_per_token(8.19e9, 36, 4096, 32768) / (6 * 8.19e9) == pytest.approx(1.59, abs=0.005)
    assert cost.training_gpu_seconds(1e6, 6e9, 1e15, 0.5) == pytest.approx(12)


def test_the_kv_cache_of_a_token_and_what_the_engine_holds():
    assert cost.kv_bytes_per_token(36, 1024) == 147_456  # Qwen3-8B: 2 x 36 layers x 8 heads x 128 x 2 bytes
    # half of 100 GB, less 10 GB of weights, at 2,000 bytes a token: the share is the engine's own budget
    assert cost.kv_capacity_tokens(100e9, 0.5, 10e9, 2000) == pytest.approx(2e7)
    assert cost.kv_capacity_tokens(10e9, 0.5, 10e9, 2000) == 0  # nothing left: no cache, never negative
    # the one-GPU smoke on an H100 (85.0e9 bytes as vLLM reads them) at 0.35: 91K tokens; vLLM reported 79,280,
    # its 1.5 GiB of peak activations out of the share
    assert cost.kv_capacity_tokens(85.02e9, 0.35, 16.4e9, 147_456) == pytest.approx(90_584, rel=1e-3)


def test_a_colocated_engine_must_fit_beside_the_trainer():
    cost.check_engine_beside_trainer(80e9, 0.5, 40e9)  # exactly the GPU
    with pytest.raises(ValueError, match="rl.vllm_gpu_memory_utilization 0.6 asks 45 GiB of a 75 GiB GPU"):
        cost.check_engine_beside_trainer(80e9, 0.6, 40e9)
    assert cost.rl_engine_memory_fraction({"engine": "hf"}) is None
    assert cost.rl_engine_memory_fraction({"engine": "vllm"}) == 0.35  # RLConfig's default
    assert cost.rl_engine_memory_fraction({"engine": "vllm", "vllm_gpu_memory_utilization": 0.6}) == 0.6


def test_a_decoded_token_attends_to_the_history_of_its_turn():
    # turns start at 1,000, 1,000 + 4,096 + 600 and 1,000 + 2 x 4,696 tokens; + half an answer (2,048) each
    assert cost.mean_decode_context(3, 4096, 1000, 600) == pytest.approx((3048 + 7744 + 12440) / 3)


def test_the_decode_batch_is_capped_by_sequences_the_engine_and_the_kv_cache():
    assert cost.decode_batch(32, 256, 1e6, 10_000) == 32  # the sequences there are
    assert cost.decode_batch(300, 256, 1e6, 10_000) == 100  # the cache holds 100 of 10K tokens
    assert cost.decode_batch(300, 64, 1e7, 10_000) == 64  # the engine's limit
    assert cost.decode_batch(0.5, 64, 1e3, 10_000) == 1  # at least one


def test_a_decode_step_reads_the_weights_and_the_kv_cache_unless_compute_takes_longer():
    # (16 GB + 10 sequences x 1,000 tokens x 100 KB) / (4 TB/s x 0.5) = 8.5 ms; compute 10 x 16 GFLOP / 5e14
    assert cost.decode_step_seconds(10, 1000, 16e9, 1e5, 4e12, 0.5, 8e9, 1e15, 0.5) == pytest.approx(8.5e-3)
    # 1,000 sequences, no context: 16 TFLOP at 5e14 FLOP/s (32 ms) is longer than 8 ms of weight reads
    assert cost.decode_step_seconds(1000, 0, 16e9, 1e5, 4e12, 0.5, 8e9, 1e15, 0.5) == pytest.approx(0.032)
    assert cost.decode_tokens_per_s(10, 8.5e-3) == pytest.approx(1176.47, abs=0.01)


def test_a_measured_decode_rate_gives_back_the_bandwidth_efficiency_of_its_step():
    # the step above: 10 sequences in 8.5 ms are 1,176.47 tokens/s, read back at 0.5 of 4 TB/s
    assert cost.implied_bandwidth_efficiency(10 / 8.5e-3, 10, 1000, 16e9, 1e5, 4e12) == pytest.approx(0.5)
    # by hand: (16 GB + 64 x 4,000 x 147,456 B) / 4.8 TB/s = 11.2 ms of reads at full bandwidth; 2,000 tokens/s
    # at batch 64 is a 32 ms step, so 0.35 of the bandwidth
    reads = (16e9 + 64 * 4000 * 147_456) / 4.8e12
    assert cost.implied_bandwidth_efficiency(2000, 64, 4000, 16e9, 147_456, 4.8e12) == pytest.approx(reads / 0.032)
    assert reads / 0.032 == pytest.approx(0.35, abs=0.005)


def test_no_step_ends_before_its_longest_answer():
    # 2 turns of 100 tokens at 1 us a token of context: turn 1 at 1,000 + 50, turn 2 at 1,000 + 150 + 50
    assert cost.longest_answer_floor_seconds(2, 100, 1000, 50, lambda context: context * 1e-6) == pytest.approx(
        100 * 1050e-6 + 100 * 1200e-6)


def test_rollout_adds_prefill_and_decode_time():
    assert cost.rollout_gpu_seconds(1000, 4800, 500, 480) == pytest.approx(2 + 10)


def test_kernelgym_seconds_from_its_rate():
    assert cost.kernelgym_gpu_seconds(62, 31) == pytest.approx(120)


def test_weight_sync_moves_the_bf16_weights():
    assert cost.weight_sync_seconds(8e9, 2, 20e9) == pytest.approx(0.8)


def test_the_offloaded_optimizer_streams_its_host_state_in_and_out():
    assert cost.optimizer_step_seconds(8e9, 1, 8, 40e9) == pytest.approx(3.2)  # 2 x 64 GB at 40 GB/s
    assert cost.optimizer_step_seconds(8e9, 2, 8, 40e9) == pytest.approx(1.6)  # each GPU its shard
    assert cost.optimizer_step_seconds(8e9, 1, 0, 40e9) == 0  # nothing on the host


def test_host_memory_and_disk_a_run_needs():
    assert cost.host_memory_needed(8e9, 12, 24e9) == pytest.approx(120e9)
    assert cost.disk_needed(8e9, 6, 10e9) == pytest.approx(58e9)  # 6 bytes a parameter and 10 GB beside them


SIZES = cost.DiskSizes(checkpoint=4, export=2, state=12)


def test_sft_holds_its_base_its_export_and_its_unfinished_checkpoints():
    assert cost.sft_disk_bytes_per_param(2, 0, SIZES) == 6  # a bf16 base and the fp32 export
    assert cost.sft_disk_bytes_per_param(2, 2, SIZES) == 6 + 2 * (4 + 12)


@pytest.mark.parametrize(("iterations", "steps", "final", "keep", "peak"), [
    (1, 1, "evaluation", False, 2),  # issue 63's one step on one GPU: a bf16 model, no state
    (1, 1, "trainer", False, 4 + 12),
    (3, 1, "trainer", False, 8 + 12 + 16),  # the last iteration: two models, the state it reads, its own model and state
    (3, 1, "evaluation", False, 4 + 12 + 16),  # the middle one holds the most: its last model is bf16, stateless
    (2, 10, "trainer", False, 4 + 12 + 16 + 16),  # a scratch checkpoint beside the outputs (or two in a save)
    (3, 1, "trainer", True, 8 + 24 + 16),  # every state kept
])
def test_rl_holds_every_model_and_the_states_in_flight(iterations, steps, final, keep, peak):
    assert cost.rl_disk_bytes_per_param(iterations, steps, 1, 1, final, keep, SIZES) == peak


def test_an_iteration_without_step_checkpoints_holds_no_scratch_checkpoint():
    assert cost.rl_disk_bytes_per_param(1, 2, 1, 1, "evaluation", False, SIZES, step_checkpoints=False) == 2
    assert cost.rl_disk_bytes_per_param(1, 2, 1, 1, "evaluation", False, SIZES) == 2 * (4 + 12)


def test_finished_runs_keep_their_models_and_last_state():
    assert cost.rl_disk_bytes_per_param(1, 1, 3, 2, "trainer", False, SIZES) == 16 + 2 * 16
    assert cost.rl_disk_bytes_per_param(1, 1, 3, 2, "evaluation", False, SIZES) == 2 + 2 * 2


def test_job_wall_spreads_work_after_start_up():
    assert cost.job_wall_seconds(100, 4, 10) == pytest.approx(35)


def test_a_later_turn_prefills_only_its_feedback():
    assert cost.trajectory_tokens(3, 8192, 0.5, 1000, 600) == (2200, 12288, 14488)


def test_rl_trains_a_row_a_turn_with_its_whole_context():
    assert cost.turn_row_tokens(3, 8192, 0.5, 1000, 600) == [5096, 9792, 14488]


def figure(name: str, value: float) -> Figure:
    return Figure(name, value, "unit", "estimated", "round number for a hand computation")


ROUND_UNITS = Units(
    figures={name: figure(name, value) for name, value in {
        "training_mfu": 0.5, "prefill_mfu": 0.5, "decode_bandwidth_efficiency": 0.5, "decode_max_sequences": 10,
        "vllm_gpu_memory_fraction": 0.5, "decode_tokens_per_s_0_6b": 1000, "kernelgym_evaluations_per_min_per_gpu": 30,
        "weight_sync_bytes_per_s": 1e9, "bytes_per_parameter": 2, "vllm_startup_s": 100, "trainer_startup_s": 50,
        "prompt_tokens": 1000, "feedback_tokens": 500, "response_fill": 0.5, "sft_batch_size": 10,
        "host_copy_bytes_per_s": 1e9, "sleep_wake_s": 5, "host_memory_overhead_bytes": 0,
        "checkpoint_bytes_per_parameter": 4, "optimizer_state_bytes_per_parameter": 12,
        "disk_overhead_bytes": 0}.items()},
    gpu_kinds={"h200": {"peak_bf16_flops": figure("peak", 1e15), "hbm_bytes_per_s": figure("hbm", 4e12),
                        "memory_bytes": figure("memory", 100e9), "host_memory_bytes_per_gpu": figure("host", 1e12),
                        "disk_bytes_per_gpu": figure("disk", 1e13)}},
    models={"m": figure("m", 1e9)},
    architectures={"m": Architecture(layers=10, attention_width=100, kv_width=50)},  # 2,000 bytes of KV a token
)


def small_config(rl_async: str = "off") -> dict:
    return {
        "run": "small",
        "kernelbench": {"version": "main", "levels": [1], "ids": None},
        "policy": {"base_model": "m"},
        "distill": {"teacher": "offline", "max_queries": 10, "samples": 2, "turns": 3, "sampling": {"max_tokens": 2000}},
        "sft": {"epochs": 1, "max_steps": None, "gpus": 2},
        "rl": {"base_run": False, "runs": {"a": {}}, "gpus": 2, "prompts_per_step": 2, "rollouts_per_prompt": 2,
               "max_turns": 2, "max_tokens": 1000, "async": rl_async, "iterations": 2, "steps_per_iteration": 3,
               "validation": {"every": 0}},
        "models": [{"name": "p", "kind": "pipeline"}, {"name": "api", "kind": "openai"}],
        "eval": {"models": ["p", "api"], "levels": None, "max_tasks": 2, "samples": 1, "turns": 1,
                 "sampling": {"max_tokens": 1000}},
        "stts": {"enabled": False},
    }


# the small RL step by hand: 2 x 2 trajectories of 2 turns on 2 GPUs, memory plan "gpu" (16 GB over 2 GPUs and 40 GiB
# of activations fit 100 GB): KV of 2,000 bytes a token, mean context (1,250 + 2,250) / 2 = 1,750, batch 2 a replica;
# a step reads 2 GB + 2 x 1,750 x 2,000 B at 2 TB/s: 1.0035 ms, 1,993.02 tokens/s; prefill 250,000 tokens/s
ROLLOUT = 4 * 1500 / 250_000 + 4 * 1000 / (2 / 1.0035e-3)
FLOOR = 1000 * (2e9 + 1500 * 2000) / 2e12 + 1000 * (2e9 + 3000 * 2000) / 2e12  # turns at contexts 1,500 and 3,000
# RL trains a row a turn (context + answer): rows of 1,500 and 1,000 + 500 + 500 + 500 = 2,500 tokens
TRAIN = 4 * sum(row * 4 * (2e9 + 2 * 10 * 100 * row) for row in (1500, 2500)) / 5e14  # 4 passes: the old log-probs, forward and backward
STEP = max(ROLLOUT / 2, FLOOR) + 8 * 2 / 2 + TRAIN / 2 + 0 + 2 + 5  # + KernelGym 16 GPU-s + optimizer + push + sleep/wake


def test_a_small_plan_by_hand():
    stages = {stage.name: stage for stage in cost.plan_cost(small_config(), ROUND_UNITS, 2, "h200").stages}
    # distill: 10 queries x 2 samples x 3 turns = 60 evaluations at 30/min
    assert stages["distill"].gpu_seconds == pytest.approx(120) and stages["distill"].wall_s == pytest.approx(60)
    # sft: 20 samples of 1,000 + 2 x 500 prefill + 3 x 1,000 decode = 5,000 tokens, 3 x (2e9 + 2 x 10 x 100 x 5,000)
    # FLOPs each at 5e14 FLOP/s; the optimizer steps on the GPUs
    assert stages["sft"].gpu_seconds == pytest.approx(1.206) and stages["sft"].wall_s == pytest.approx(0.603 + 50)
    assert STEP == pytest.approx(2.0045 + 8 + 0.128272 + 7)
    assert stages["rl"].wall_s == pytest.approx(2 * (3 * STEP + 150))
    assert stages["rl"].gpu_seconds == pytest.approx(2 * (3 * STEP + 150) * 2)  # both GPUs held throughout
    # eval: the pipeline model only, 2 level-1 tasks x 1 sample x 1 turn, batch 1 at context 1,250 (1.00125 ms a
    # token): rollout 2 x 1,000 / 250,000 + 2 x 500 x 1.00125e-3 s; floor 1,000 tokens at context 1,500; 2 evaluations
    rollout = 0.008 + 1.00125
    assert stages["eval"].gpu_seconds == pytest.approx(rollout + 4)
    assert stages["eval"].wall_s == pytest.approx(max(rollout / 2, 1.0015) + 4 / 2 + 100)
    assert "not costed (API or served checkpoints): api" in stages["eval"].note
    assert set(stages) == {"distill", "sft", "rl", "eval"}


def test_kernelgym_on_gpus_of_its_own_overlaps_rollouts_under_async_eval():
    """rl.async eval with 1 of 3 GPUs judging: the step waits for the longer of rollouts (the 2-s floor) and
    KernelGym (16 GPU-s on its one GPU), not their sum; on the jobs' GPUs it is serialised, async or not."""
    shared = next(s for s in cost.plan_cost(small_config("eval"), ROUND_UNITS, 2, "h200").stages if s.name == "rl")
    assert shared.wall_s == pytest.approx(2 * (3 * STEP + 150))
    own = next(s for s in cost.plan_cost(small_config("eval"), ROUND_UNITS, 3, "h200", gym_gpus=1).stages
               if s.name == "rl")
    own_step = max(max(ROLLOUT / 2, FLOOR), 16 / 1) + TRAIN / 2 + 2 + 5
    assert own.wall_s == pytest.approx(2 * (3 * own_step + 150))
    with pytest.raises(ValueError, match="--gym-gpus must leave a GPU"):
        cost.plan_cost(small_config(), ROUND_UNITS, 1, "h200", gym_gpus=1)


def test_the_trainer_offloads_its_optimizer_where_the_gpu_is_too_small():
    """On one GPU of 55 GB the 'gpu' plan (16 GB + 40 GiB) does not fit, 'fp32' (8 GB + 40 GiB) does: every step
    streams 8 GB of moments in and out at 1 GB/s (16 s); a colocated vLLM engine takes its share beside the
    trainer's 4 GB of fp32 weights, and one that does not fit beside them is refused."""
    small = Units(ROUND_UNITS.figures, {"h200": {**ROUND_UNITS.gpu_kinds["h200"], "memory_bytes": figure("m", 55e9)}},
                  ROUND_UNITS.models, ROUND_UNITS.architectures)
    config = small_config()
    config["rl"].update(gpus=1, optimizer_offload="auto", engine="vllm", vllm_gpu_memory_utilization=0.6)
    config["sft"]["optimizer_offload"] = "auto"
    rl = next(s for s in cost.plan_cost(config, small, 1, "h200").stages if s.name == "rl")
    assert "memory plan fp32" in rl.note and "optimizer 16.0 s" in rl.note
    assert "KV cache 15500K tokens" in rl.note  # (55 GB x 0.6 - 2 GB of bf16 weights) / 2,000 bytes
    config["rl"]["vllm_gpu_memory_utilization"] = 0.95  # 52 GB beside the trainer's 4 GB: vLLM would not start
    with pytest.raises(ValueError, match="rl.vllm_gpu_memory_utilization 0.95 asks 49 GiB of a 51 GiB GPU beside"):
        cost.plan_cost(config, small, 1, "h200")
    config["rl"]["vllm_gpu_memory_utilization"] = 0.6
    config["rl"]["optimizer_offload"] = False  # YAML's bare `off`: AdamW on the GPU, as the run would, refused
    with pytest.raises(ValueError, match=r"do not fit 1 GPU\(s\) of 51 GiB under any memory plan \(gpu\)"):
        cost.plan_cost(config, small, 1, "h200")


def test_a_job_asking_more_gpus_than_the_machine_has_is_planned_on_all_and_said():
    plan_ = cost.plan_cost(small_config(), ROUND_UNITS, 1, "h200")
    assert "rl: 2 GPUs asked, 1 available: planned on 1 (lower rl.gpus)" in plan_.notes


def test_unknown_model_or_kind_is_a_clear_error():
    config = small_config()
    config["policy"]["base_model"] = "Qwen/Qwen9"
    with pytest.raises(ValueError, match="no parameter count for policy.base_model 'Qwen/Qwen9'"):
        cost.plan_cost(config, ROUND_UNITS, 2, "h200")
    with pytest.raises(ValueError, match="unknown GPU kind 'a100'"):
        cost.plan_cost(small_config(), ROUND_UNITS, 2, "a100")


def test_every_unit_says_its_source(tmp_path):
    units = cost.load_units(ROOT / "config" / "cost_units.yaml")
    for figure_ in [*units.figures.values(), *units.models.values(),
                    *(f for kind in units.gpu_kinds.values() for f in kind.values())]:
        assert figure_.source in ("measured", "estimated") and figure_.why
        if figure_.source == "measured":
            assert (ROOT / figure_.report).is_file(), figure_.name
    bad = tmp_path / "units.yaml"
    bad.write_text("units: {x: {value: 1, unit: s, source: measured, why: w}}\ngpu_kinds: {}\nmodels: {}\n")
    with pytest.raises(ValueError, match="x is measured but names no report"):
        cost.load_units(bad)


def run_plan(*args: str) -> str:
    result = CliRunner().invoke(plan, ["--cost", "--base", str(ROOT / "config" / "config.yaml"),
                                       "--units", str(ROOT / "config" / "cost_units.yaml"), *args])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("gpus, kind", [("8", "h100"), ("4", "H200")])
def test_the_paper_run_on_either_machine(gpus, kind):
    output = run_plan("--configfile", str(ROOT / "config" / "paper.yaml"), "--gpus", gpus, "--gpu-kind", kind,
                      "--disk-gib", "4000")
    first = output.splitlines()[0]
    assert first.startswith("ESTIMATED, NOT MEASURED: ") and "trainer_startup_s" in first
    for unit in ("training_mfu", "host_copy_bytes_per_s", "prefill_mfu", "decode_bandwidth_efficiency",
                 "weight_sync_bytes_per_s", "sleep_wake_s", "vllm_startup_s"):
        assert unit not in first  # measured, in paper_units.md
    assert "kernelgym_evaluations_per_min_per_gpu" not in first  # measured, in gym_scaling.md
    assert f"{gpus} x {kind.upper()}" in output
    for stage in ("distill", "sft", "rl", "rl_validate", "eval", "stts"):
        assert f"\n{stage} " in output
    assert "critical path: distill -> sft -> rl" in output
    assert "the paper: the paper reports its hardware (NVIDIA H100" in output
    assert "(measured, docs/gpu-results/gym_scaling.md)" in output
    assert ("rl: 8 GPUs asked, 4 available" in output) == (gpus == "4")


def test_the_14b_and_the_smoke_overlays():
    paper = str(ROOT / "config" / "paper.yaml")
    b14 = run_plan("--configfile", paper, str(ROOT / "config" / "paper_14b.yaml"), "--gpus", "8", "--gpu-kind", "h100",
                   "--disk-gib", "5000")
    assert "Qwen/Qwen3-14B-Base = 1.48e+10 parameters" in b14 and "1 run(s) x 300 steps" in b14
    smoke = run_plan("--configfile", paper, str(ROOT / "config" / "paper_smoke.yaml"), "--gpus", "4", "--gpu-kind", "h200",
                     "--disk-gib", "400")
    assert "1 run(s) x 2 steps of 16 trajectories x 3 turns" in smoke


@pytest.mark.parametrize("kind", ["h200", "h100"])
def test_issue_63s_step_fits_one_lent_gpu_machine_by_the_plans_own_count(kind, tmp_path):
    """config/paper_smoke_1gpu.yaml on the units' one-GPU machine (64 GiB of disk, 128 GiB of host): the SFT model
    in fp32 and the RL iteration's bf16 model at once, 6 bytes a parameter, the built base gone after SFT; no scratch
    checkpoint between the two steps (rl.step_checkpoints: false)."""
    configs = [str(ROOT / "config" / name) for name in ("paper.yaml", "paper_smoke.yaml", "paper_smoke_1gpu.yaml")]
    output = run_plan("--configfile", *configs, "--gpus", "1", "--gpu-kind", kind)
    assert "1 run(s) x 2 steps of 4 trajectories x 3 turns on 1 GPUs" in output
    machine = next(line for line in output.splitlines() if line.strip().startswith("machine:"))
    assert "55 of 64 GiB disk (at its fullest during RL: 6 bytes a parameter" in machine
    assert "a bf16 model and no optimizer state" in machine
    assert " of 128 GiB host memory" in machine
    # without the overlay's final_checkpoint, one GPU's disk does not hold the iteration's fp32 model and state
    trainer = tmp_path / "trainer.yaml"
    trainer.write_text("rl: {final_checkpoint: trainer}\n")
    scratch = tmp_path / "scratch.yaml"
    scratch.write_text("rl: {step_checkpoints: true}\n")
    result = CliRunner().invoke(plan, ["--cost", "--base", str(ROOT / "config" / "config.yaml"), "--units",
                                       str(ROOT / "config" / "cost_units.yaml"), "--configfile", *configs,
                                       str(trainer),
                                       "--gpus", "1", "--gpu-kind", kind])
    assert result.exit_code != 0 and "of disk (has 64; at its fullest during RL: 20 bytes a parameter" in result.output
    # nor, with step checkpoints, a scratch checkpoint (a model and its state) beside the two models
    result = CliRunner().invoke(plan, ["--cost", "--base", str(ROOT / "config" / "config.yaml"), "--units",
                                       str(ROOT / "config" / "cost_units.yaml"), "--configfile", *configs,
                                       str(scratch), "--gpus", "1", "--gpu-kind", kind])
    assert result.exit_code != 0 and "at its fullest during RL: 36 bytes a parameter" in result.output


def test_plan_without_cost_says_so():
    result = CliRunner().invoke(plan, ["--configfile", str(ROOT / "config" / "paper.yaml"), "--gpus", "8",
                                       "--gpu-kind", "h100"])
    assert result.exit_code != 0 and "pass --cost" in result.output


def write_benchmark(logs: Path, name: str, seconds: float) -> None:
    """A Snakemake benchmark file as `benchmark:` writes it: a header, then one row per repeat."""
    path = logs / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"s\th:m:s\tmax_rss\n{seconds}\t0:00:00\t1.0\n")


def test_a_finished_run_is_compared_stage_by_stage(tmp_path):
    """The small plan's sft job is 50.6 s and its RL run 2 x (3 x 17.133 + 150) = 402.8 s (by hand above)."""
    plan_ = cost.plan_cost(small_config(), ROUND_UNITS, 2, "h200")
    write_benchmark(tmp_path, "benchmarks/sft-small.tsv", 50.6)
    write_benchmark(tmp_path, "benchmarks/rl-small/a-iter0.tsv", 100.0)
    write_benchmark(tmp_path, "benchmarks/rl-small/a-iter1.tsv", 100.0)
    rows = {line.split()[0]: line.split() for line in cost.format_comparison(plan_, tmp_path).splitlines()[1:]}
    assert rows["sft"] == ["sft", "51", "51", "1.00", "yes"]
    assert rows["rl"] == ["rl", "403", "200", "2.01", "NO"]
    (tmp_path / "benchmarks/rl-small/a-iter1.tsv").unlink()
    with pytest.raises(ValueError, match="no benchmark .*rl-small/a-iter1.tsv"):
        cost.format_comparison(plan_, tmp_path)


def test_a_stage_a_run_stopped_before_is_said_not_run(tmp_path):
    """`snakemake --until rl_iter` leaves later stages unrun: the comparison says so instead of failing."""
    write_benchmark(tmp_path, "benchmarks/sft-small.tsv", 50.6)
    rows = {line.split()[0]: line.split() for line in cost.format_comparison(
        cost.plan_cost(small_config(), ROUND_UNITS, 2, "h200"), tmp_path).splitlines()[1:]}
    assert rows["sft"] == ["sft", "51", "51", "1.00", "yes"] and rows["rl"] == ["rl", "403", "not", "run"]


def test_measured_without_the_runs_benchmarks_is_a_clear_error(tmp_path):
    result = CliRunner().invoke(plan, [
        "--cost", "--base", str(ROOT / "config" / "config.yaml"), "--units", str(ROOT / "config" / "cost_units.yaml"),
        "--configfile", str(ROOT / "config" / "paper.yaml"), str(ROOT / "config" / "paper_smoke.yaml"),
        "--gpus", "4", "--gpu-kind", "h200", "--disk-gib", "400", "--measured", str(tmp_path)])
    assert result.exit_code != 0 and "no benchmark" in result.output and "sft-paper-smoke.tsv" in result.output


def test_a_real_size_local_preset_is_priced_as_the_model_whose_shapes_it_copies():
    from kpipe.report.cost import policy_architecture

    assert policy_architecture({"policy": {"base_model": "tiny", "tiny": {"size": "qwen3-8b"}}}) == "Qwen/Qwen3-8B-Base"
    assert policy_architecture({"policy": {"base_model": "tiny", "tiny": {"size": "nano"}}}) == "tiny:nano"
    assert policy_architecture({"policy": {"base_model": "Qwen/Qwen3-14B-Base"}}) == "Qwen/Qwen3-14B-Base"


def test_the_paper_on_one_gpu_offloads_its_optimizer_and_names_what_the_machine_must_hold():
    paper = str(ROOT / "config" / "paper.yaml")
    h200 = run_plan("--configfile", paper, "--gpus", "1", "--gpu-kind", "h200", "--disk-gib", "4000")
    assert "memory plan fp32" in h200 and "83 of 128 GiB host memory" in h200  # 8 bytes a parameter + 24 GB
    h100 = run_plan("--configfile", paper, "--gpus", "1", "--gpu-kind", "h100", "--disk-gib", "4000")
    assert "memory plan bf16" in h100 and "114 of 128 GiB host memory" in h100  # the fp32 master on the host too


@pytest.mark.parametrize("extra, short", [
    ((), "2,282 GiB of disk (has 64"),  # 61 fp32 checkpoints of 32.8 GB, states and scratch on the lent 64 GiB
    (("--disk-gib", "4000", "--host-memory-gib", "100"), "114 GiB of host memory (has 100"),
])
def test_a_one_gpu_plan_that_does_not_fit_the_host_is_refused_in_one_line(extra, short):
    result = CliRunner().invoke(plan, [
        "--cost", "--base", str(ROOT / "config" / "config.yaml"), "--units", str(ROOT / "config" / "cost_units.yaml"),
        "--configfile", str(ROOT / "config" / "paper.yaml"), "--gpus", "1", "--gpu-kind", "h100", *extra])
    assert result.exit_code != 0 and "the run does not fit 1 x H100" in result.output and short in result.output
    assert len(result.output.strip().splitlines()) == 1
