"""The cost model of `kpipe plan --cost` (issue 54): each formula against a hand computation, a whole plan of a
small config computed by hand, the units file's sources, and the command's report for the paper's runs."""

from pathlib import Path

import pytest
from click.testing import CliRunner

from kpipe.report import cost
from kpipe.report.cost import Figure, Units
from kpipe.report.cost_cli import plan

ROOT = Path(__file__).resolve().parents[1]


def test_prefill_is_compute_bound():
    assert cost.prefill_tokens_per_s(989e12, 0.5, 8e9) == pytest.approx(989e12 * 0.5 / 16e9)  # 30,906 tokens/s


def test_decode_is_bandwidth_bound():
    # 4.8 TB/s over 16 GB of bf16 weights: 300 steps/s, x 64 sequences x 0.25
    assert cost.decode_tokens_per_s(4.8e12, 8e9, 2, 64, 0.25) == pytest.approx(4800)


def test_rollout_adds_prefill_and_decode_time():
    assert cost.rollout_gpu_seconds(1000, 4800, 500, 480) == pytest.approx(2 + 10)


def test_training_is_six_flops_per_parameter_and_token():
    assert cost.training_gpu_seconds(1e6, 1e9, 1e15, 0.5) == pytest.approx(12)
    assert cost.training_gpu_seconds(1e6, 1e9, 1e15, 0.5, flops_per_param=8) == pytest.approx(16)


def test_kernelgym_seconds_from_its_rate():
    assert cost.kernelgym_gpu_seconds(62, 31) == pytest.approx(120)


def test_weight_sync_moves_the_bf16_weights():
    assert cost.weight_sync_seconds(8e9, 2, 20e9) == pytest.approx(0.8)


def test_job_wall_spreads_work_after_start_up():
    assert cost.job_wall_seconds(100, 4, 10) == pytest.approx(35)


def test_a_later_turn_prefills_only_its_feedback():
    assert cost.trajectory_tokens(3, 8192, 0.5, 1000, 600) == (2200, 12288, 14488)


def figure(name: str, value: float) -> Figure:
    return Figure(name, value, "unit", "estimated", "round number for a hand computation")


ROUND_UNITS = Units(
    figures={name: figure(name, value) for name, value in {
        "training_mfu": 0.5, "prefill_mfu": 0.5, "decode_concurrency": 10, "decode_batch_efficiency": 0.5,
        "decode_tokens_per_s_0_6b": 1000, "kernelgym_evaluations_per_min_per_gpu": 30,
        "weight_sync_bytes_per_s": 1e9, "bytes_per_parameter": 2, "vllm_startup_s": 100, "trainer_startup_s": 50,
        "prompt_tokens": 1000, "feedback_tokens": 500, "response_fill": 0.5, "sft_batch_size": 10}.items()},
    gpu_kinds={"h200": {"peak_bf16_flops": figure("peak", 1e15), "hbm_bytes_per_s": figure("hbm", 4e12)}},
    models={"m": figure("m", 1e9)},
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


def test_a_small_plan_by_hand():
    """prefill 250,000 tokens/s (1e15 x 0.5 / 2e9), decode 10,000 (4e12 / 2e9 x 10 x 0.5), 2 GPUs."""
    stages = {stage.name: stage for stage in cost.plan_cost(small_config(), ROUND_UNITS, 2, "h200").stages}
    # distill: 10 queries x 2 samples x 3 turns = 60 evaluations at 30/min
    assert stages["distill"].gpu_seconds == pytest.approx(120) and stages["distill"].wall_s == pytest.approx(60)
    # sft: 20 samples of 1000 + 2 x 500 prefill + 3 x 1000 decode = 5000 tokens, 6 x 1e9 FLOPs each at 5e14 FLOP/s
    assert stages["sft"].gpu_seconds == pytest.approx(1.2) and stages["sft"].wall_s == pytest.approx(0.6 + 50)
    # rl step: 4 trajectories; rollout 4 x 1500 / 250,000 + 4 x 1000 / 10,000 = 0.424 s; KernelGym 8 evaluations
    # = 16 s; update 4 x 2500 tokens x 8 x 1e9 / 5e14 = 0.16 s; push 2e9 B / 1e9 B/s = 2 s; start-up 150 s
    step_wall = (0.424 + 16) / 2 + 0.16 / 2 + 2
    assert stages["rl"].wall_s == pytest.approx(2 * (3 * step_wall + 150))
    assert stages["rl"].gpu_seconds == pytest.approx(6 * (0.424 + 16 + 0.16 + 2 * 2) + 2 * 150 * 2)
    # eval: the pipeline model only, 2 level-1 tasks x 1 sample x 1 turn: 2 x 1000 / 250,000 + 2 x 500 / 10,000
    # + 2 evaluations (4 s)
    assert stages["eval"].gpu_seconds == pytest.approx(0.108 + 4)
    assert stages["eval"].wall_s == pytest.approx((0.108 + 4) / 2 + 100)
    assert "not costed (API or served checkpoints): api" in stages["eval"].note
    assert set(stages) == {"distill", "sft", "rl", "eval"}


def test_asynchronous_evaluation_overlaps_rollouts():
    """rl.async eval: the step waits for the longer of rollouts (0.424 s) and KernelGym (16 s), not their sum."""
    rl = next(s for s in cost.plan_cost(small_config("eval"), ROUND_UNITS, 2, "h200").stages if s.name == "rl")
    assert rl.wall_s == pytest.approx(2 * (3 * (16 / 2 + 0.16 / 2 + 2) + 150))


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
    output = run_plan("--configfile", str(ROOT / "config" / "paper.yaml"), "--gpus", gpus, "--gpu-kind", kind)
    first = output.splitlines()[0]
    assert first.startswith("ESTIMATED, NOT MEASURED: ") and "training_mfu" in first
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
    b14 = run_plan("--configfile", paper, str(ROOT / "config" / "paper_14b.yaml"), "--gpus", "8", "--gpu-kind", "h100")
    assert "Qwen/Qwen3-14B-Base = 1.48e+10 parameters" in b14 and "1 run(s) x 300 steps" in b14
    smoke = run_plan("--configfile", paper, str(ROOT / "config" / "paper_smoke.yaml"), "--gpus", "4", "--gpu-kind", "h200")
    assert "1 run(s) x 2 steps of 16 trajectories x 3 turns" in smoke


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
    """The small plan's sft job is 50.6 s and its RL run 2 x (3 x 10.292 + 150) = 361.752 s (by hand above)."""
    plan_ = cost.plan_cost(small_config(), ROUND_UNITS, 2, "h200")
    write_benchmark(tmp_path, "benchmarks/sft-small.tsv", 50.6)
    write_benchmark(tmp_path, "benchmarks/rl-a-iter0.tsv", 100.0)
    write_benchmark(tmp_path, "benchmarks/rl-a-iter1.tsv", 100.0)
    rows = {line.split()[0]: line.split() for line in cost.format_comparison(plan_, tmp_path).splitlines()[1:]}
    assert rows["sft"] == ["sft", "51", "51", "1.00", "yes"]
    assert rows["rl"] == ["rl", "362", "200", "1.81", "NO"]
    (tmp_path / "benchmarks/rl-a-iter1.tsv").unlink()
    with pytest.raises(ValueError, match="no benchmark .*rl-a-iter1.tsv"):
        cost.format_comparison(plan_, tmp_path)


def test_measured_without_the_runs_benchmarks_is_a_clear_error(tmp_path):
    result = CliRunner().invoke(plan, [
        "--cost", "--base", str(ROOT / "config" / "config.yaml"), "--units", str(ROOT / "config" / "cost_units.yaml"),
        "--configfile", str(ROOT / "config" / "paper.yaml"), str(ROOT / "config" / "paper_smoke.yaml"),
        "--gpus", "4", "--gpu-kind", "h200", "--measured", str(tmp_path)])
    assert result.exit_code != 0 and "no benchmark" in result.output and "sft-paper-smoke.tsv" in result.output


def test_a_real_size_local_preset_is_priced_as_the_model_whose_shapes_it_copies():
    from kpipe.report.cost import policy_architecture

    assert policy_architecture({"policy": {"base_model": "tiny", "tiny": {"size": "qwen3-8b"}}}) == "Qwen/Qwen3-8B-Base"
    assert policy_architecture({"policy": {"base_model": "tiny", "tiny": {"size": "nano"}}}) == "tiny:nano"
    assert policy_architecture({"policy": {"base_model": "Qwen/Qwen3-14B-Base"}}) == "Qwen/Qwen3-14B-Base"
