"""checks/gpu/paper_units.py: the arithmetic it reports and the whole check on a nano model on the CPU (vLLM,
absent here, is skipped with a reason), so that its one cold run on the device does not fail on plumbing."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from checks.gpu import paper_units

ROOT = Path(__file__).resolve().parents[1]


def test_training_flops_count_weights_and_causal_attention():
    # 6 N t + 6 L d t^2: N 100, t 10, L 2, d 4 -> 6,000 + 4,800
    assert paper_units.training_flops(100, 2, 4, 10) == 10_800


def test_a_step_past_its_limit_is_a_failure_and_the_next_step_runs(tmp_path):
    from checks.gpu.harness import Report

    facts = dict.fromkeys(("commit", "date", "device", "driver", "torch", "cuda", "triton", "python"), "x")
    report = Report("paper_units", "t", facts, out=tmp_path)
    report.begin("training")

    def slow() -> dict:
        import time
        time.sleep(5)
        return {}

    assert paper_units.step(report, "slow", 1, slow) is None
    assert paper_units.step(report, "fast", 5, lambda: {"x": 1.0}) == {"x": 1.0}
    assert report.failures == ["training: slow"] and report.data == {"fast": {"x": 1.0}}
    assert (tmp_path / "paper_units.json").exists()  # saved after each step


def test_the_check_runs_on_a_nano_model_on_the_cpu(tmp_path):
    done = subprocess.run([sys.executable, "-m", "checks.gpu", "paper_units", "--tiny", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    report = json.loads((tmp_path / "paper_units.json").read_text())
    numerics = report["sections"]["optimizer_numerics"]["data"]
    for where in ("gpu", "host"):
        figures = numerics[f"offloaded_vs_adamw_master_on_{where}"]
        assert figures["relative_difference"] <= 1e-6 and figures["moved_fraction"] >= 0.99
    trainer = report["sections"]["trainer"]["data"]
    assert trainer["trainer_build"]["plan"] == "fp32"  # no GPU: no memory limit
    for tokens in (64, 32):
        figures = trainer[f"trainer_{tokens}"]
        assert figures["steps"] == 5 and figures["tokens_per_s"] > 0 and figures["optimizer_step_s"] > 0
        assert figures["host_peak_gib"] > 0 and len(figures["losses"]) == 5
    sft = report["sections"]["sft_long"]["data"]
    assert sft["sft_sample"]["turns"] == 5 and sft["sft_build"]["plan"] == "fp32"
    assert sft["sft_train"]["tokens"] == sft["sft_sample"]["tokens"] and len(sft["sft_train"]["losses"]) == 5
    assert sft["sft_train"]["optimizer_step_s"] > 0 and sft["sft_train"]["host_peak_gib"] > 0
    assert set(paper_units.figures(report)) >= {"train_tokens_per_s_64", "train_mfu_32", "optimizer_step_s",
                                                 "sft_tokens_per_s", "sft_mfu", "sft_step_s", "sft_optimizer_step_s",
                                                 "sft_host_peak_gib", "sft_gpu_peak_gib", "sft_sample_tokens"}
    markdown = (tmp_path / "paper_units.md").read_text()
    assert "vLLM is not installed here" in markdown and "conditions beside an engine were skipped" in markdown
    assert report["sections"]["gym_beside_vllm"]["data"]["none"]["L1_19"]["statuses"] == ["pass", "pass"]


def test_a_run_of_some_sections_keeps_the_others_of_the_current_report(tmp_path):
    """The trainer's figures measured on one card stay in the report when sft_long runs later (on another)."""
    from kpipe.infra import ledger

    for section in ("trainer", "sft_long"):
        done = subprocess.run([sys.executable, "-m", "checks.gpu", "paper_units", section, "--tiny", "--out",
                               str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    report = json.loads((tmp_path / "paper_units.json").read_text())
    assert list(report["sections"]) == ["trainer", "sft_long"] and report["part"] == ["sft_long"]
    trainer, sft = report["sections"]["trainer"], report["sections"]["sft_long"]
    assert trainer["kept"] and "trainer_64" in trainer["data"] and not sft.get("kept")
    for section in (trainer, sft):
        assert section["facts"]["device"] == "cpu" and {"commit", "date", "gpus"} <= set(section["facts"])
    markdown = (tmp_path / "paper_units.md").read_text()
    assert "Kept from earlier runs (`python -m checks.gpu paper_units SECTION ...`): trainer." in markdown
    assert markdown.count("Measured on cpu, commit ") == 2 and "(an earlier run)" in markdown
    first, second = ledger.read_ledger(tmp_path)  # each line this run's figures alone
    assert "train_tokens_per_s_64" in first["figures"] and "sft_tokens_per_s" not in first["figures"]
    assert "sft_tokens_per_s" in second["figures"] and "train_tokens_per_s_64" not in second["figures"]
    assert second["figures"]["sections"] == "sft_long"


def test_the_sft_sample_is_a_5_turn_trajectory_with_the_loss_on_the_assistant_messages_only():
    from kpipe.train.samples import IGNORE_INDEX
    from kpipe.train.tiny_model import byte_tokenizer_for

    tokenizer = byte_tokenizer_for("nano")
    messages = paper_units.trajectory_messages(30, 40, 20, 5)
    assert [m["role"] for m in messages] == ["user"] + ["assistant", "user"] * 4 + ["assistant"]
    sample = paper_units.trajectory_sample(tokenizer, messages, 32768)
    assert sample.input_ids == tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    # the labelled tokens are runs, one an assistant message: its content and its end-of-turn token, nothing else
    runs, run = [], []
    for token, label in zip(sample.input_ids, sample.labels):
        assert label in (token, IGNORE_INDEX)
        if label != IGNORE_INDEX:
            run.append(token)
        elif run:
            runs.append(run)
            run = []
    runs += [run] if run else []
    answers = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
    assert [tokenizer.decode(run) for run in runs] == answers
    assert sample.n_label_tokens == 5 * (40 + 1) and len(sample.input_ids) > 30 + 5 * 40 + 4 * 20


def test_the_replay_keeps_the_history_and_its_batch_fits_the_kv_cache():
    # 1,024 prompt tokens, 1,024-token answers, 512-token feedbacks: turn 2 starts after 2,560, turn 3 after 4,096
    assert paper_units.replay_contexts(1024, 1024, 512, 3) == [(1024, 1536.0), (2560, 3072.0), (4096, 4608.0)]
    assert paper_units.fitting_batch(128, 730_000, 5120) == 128  # an H200 at 0.9 holds them all
    assert paper_units.fitting_batch(128, 370_000, 5120) == 72  # an H100's cache: fewer, none preempted
    assert paper_units.fitting_batch(128, 1000, 5120) == 1


def test_the_trainer_weights_beside_the_engine_are_fp32_where_they_fit():
    h200, h100, params = 150.7e9, 85.5e9, 8.19e9
    assert paper_units.trainer_weights_dtype(h200, 0.6, params) == "fp32"  # 33 + 90 + 6 GB of 151
    assert paper_units.trainer_weights_dtype(h100, 0.6, params) == "bf16"  # 33 + 51 GB: the H100's plan
    assert paper_units.gpu_kind("NVIDIA H200") == "h200" and paper_units.gpu_kind("NVIDIA H100 80GB HBM3") == "h100"
    assert paper_units.gpu_kind("cpu") is None


def test_chats_differ_and_have_the_asked_length():
    chats = paper_units.batch_messages(3, 50, seed=0)
    contents = [chat[0]["content"] for chat in chats]
    assert len(set(contents)) == 3 and {len(c) for c in contents} == {50} and all(c.isascii() for c in contents)
    assert paper_units.batch_messages(3, 50, seed=0) == chats  # both engines get the same batch


def test_the_vllm_figures_are_the_cost_units():
    sections = {
        "vllm_batch": {"data": {
            "standalone": {"compile_cache": "cold", "startup_s": 80.0, "output_tokens_per_s": 4000.0},
            "kpipe_engine": {"compile_cache": "warm", "startup_s": 30.0, "output_tokens_per_s": 3600.0,
                             "kv_capacity_tokens": 731_000},
            "comparison": {"kpipe_vs_standalone": 0.9}}},
        "vllm_replay": {"data": {"replay": {
            "prefill": {"prefill_tokens_per_s": 25_000.0},
            "turns": [{"output_tokens_per_s": 5000.0, "bandwidth_efficiency": 0.6},
                      {"output_tokens_per_s": 4000.0, "bandwidth_efficiency": 0.7},
                      {"output_tokens_per_s": 3000.0, "bandwidth_efficiency": None}],
            "low_batch": [{"batch": 1, "seconds_per_token": 0.007}, {"batch": 4, "seconds_per_token": 0.008}]}}},
        "push_switch": {"data": {
            "cycle_1": {"push_s": 1.5, "push_gb_per_s": 11.0, "sleep_wake_s": 4.0, "asleep_residue_gib": 2.0},
            "cycle_2": {"push_s": 1.2, "push_gb_per_s": 13.0, "sleep_wake_s": 3.0, "asleep_residue_gib": 2.5},
            "agreement_dummy_weights": {"mrs_kept": 0, "sequences": 8},
            "agreement_1": {"mrs_kept": 8, "sequences": 8}, "agreement_2": {"mrs_kept": 7, "sequences": 8}}},
    }
    figures = paper_units.figures({"sections": sections})
    assert figures == {"vllm_startup_s": 80.0, "standalone_tokens_per_s": 4000.0, "kpipe_engine_tokens_per_s": 3600.0,
                       "kpipe_vs_standalone": 0.9, "kv_capacity_tokens": 731_000.0, "prefill_tokens_per_s": 25_000.0,
                       "replay_tokens_per_s_turn1": 5000.0, "replay_tokens_per_s_turn2": 4000.0,
                       "replay_tokens_per_s_turn3": 3000.0, "decode_bandwidth_efficiency": 0.65,
                       "seconds_per_token_batch1": 0.007, "seconds_per_token_batch4": 0.008, "push_s": 1.5,
                       "weight_sync_bytes_per_s": 11e9, "sleep_wake_s": 4.0, "asleep_residue_gib": 2.5,
                       "push_mrs_kept_fraction": 0.875}


def test_the_vllm_sections_run_end_to_end_on_a_stand_in_for_vllm(tmp_path):
    """tests/fixtures/fake_vllm answers as vLLM's offline API does: the engine processes, the sleep and wake
    order, the bucketed push and the figures run as they will on the device (the numbers mean nothing; the
    stand-in's log-probs are not the model's, so MRS's agreement fails and the check exits 1)."""
    import os

    fake = ROOT / "tests" / "fixtures" / "fake_vllm"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(fake), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "checks.gpu", "paper_units", "vllm_batch", "vllm_replay", "push_switch",
                           "--tiny", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=env)
    markdown = (tmp_path / "paper_units.md").read_text()
    assert "ERROR" not in markdown and "not installed" not in markdown, (done.stdout + done.stderr)[-3000:]
    sections = json.loads((tmp_path / "paper_units.json").read_text())["sections"]
    batch = sections["vllm_batch"]["data"]
    assert batch["standalone"]["multiprocessing"] and not batch["kpipe_engine"]["multiprocessing"]
    assert (batch["standalone"]["compile_cache"], batch["kpipe_engine"]["compile_cache"]) == ("cold", "warm")
    for engine in ("standalone", "kpipe_engine"):
        assert batch[engine]["output_tokens"] == 8 * 16 and batch[engine]["kv_capacity_tokens"] == 1600
    replay = sections["vllm_replay"]["data"]["replay"]
    assert [turn["prompt_tokens"] for turn in replay["turns"]] == [32, 56, 80]  # the history kept
    assert [low["batch"] for low in replay["low_batch"]] == [1, 4] and replay["prefill"]["prefill_tokens_per_s"] > 0
    switch = sections["push_switch"]["data"]
    assert {"engine_startup", "agreement_dummy_weights", "cycle_1", "cycle_2", "cycle_3", "agreement_3"} <= set(switch)
    assert switch["engine_startup"]["trainer_weights"] == "fp32"
    assert all(switch[f"cycle_{n}"]["push_s"] > 0 for n in (1, 2, 3))
    failures = sections["push_switch"]["failures"]
    assert done.returncode == 1 and failures and all("MRS keeps every sequence" in f for f in failures), failures
    figures = paper_units.figures({"sections": sections})
    assert {"vllm_startup_s", "kpipe_vs_standalone", "replay_tokens_per_s_turn3", "push_s", "sleep_wake_s",
            "weight_sync_bytes_per_s", "push_mrs_kept_fraction"} <= set(figures)


def test_kernelgym_beside_a_stand_in_engine_gives_each_condition_its_figures(tmp_path):
    """gym_beside_vllm on the CPU with tests/fixtures/fake_vllm: the bank's ReLU (shrunk, Triton's interpreter)
    judged twice through the pool in each condition while the engine's process is driven through its states
    (awake, decoding call after call, asleep), then the drifts and the ledger's figures."""
    import os

    fake = ROOT / "tests" / "fixtures" / "fake_vllm"
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(fake), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "checks.gpu", "paper_units", "gym_beside_vllm", "--tiny", "--out",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    report = json.loads((tmp_path / "paper_units.json").read_text())
    data = report["sections"]["gym_beside_vllm"]["data"]
    for condition in paper_units.GYM_CONDITIONS:
        figures = data[condition]["L1_19"]
        assert figures["statuses"] == ["pass", "pass"], condition
        assert figures["candidate_ms"]["median"] > 0 and figures["speedup"]["min"] <= figures["speedup"]["max"]
    assert data["engine_startup"]["kv_capacity_tokens"] == 1600 and data["engine_decoding"]["batch"] == 8
    assert data["engine_asleep"]["decode"]["calls_beside_the_gym"] > 0  # it decoded while the gym timed
    assert set(data["drift_pct"]) == {"vllm_awake", "vllm_decoding", "vllm_asleep"}
    assert {"gym_drift_awake_pct", "gym_drift_decoding_pct", "gym_drift_asleep_pct", "gym_speedup_drift_decoding_pct",
            "gym_neighbour_engine_gib"} <= set(paper_units.figures(report))
    assert "What the run does about it" in (tmp_path / "paper_units.md").read_text()


def test_the_gym_drifts_are_from_the_condition_without_vllm():
    from pytest import approx

    def task(ms: float, speedup: float) -> dict:
        return {"candidate_ms": {"median": ms}, "speedup": {"median": speedup}}

    conditions = {"none": {"A": task(2.0, 1.0), "B": task(1.0, 4.0)},
                  "vllm_decoding": {"A": task(2.5, 0.9), "B": task(0.9, 4.0)}}
    drifts = paper_units.gym_drifts(conditions)
    assert drifts["vllm_decoding"]["A"] == {"candidate_ms": approx(25.0), "speedup": approx(-10.0)}
    assert drifts["vllm_decoding"]["B"] == {"candidate_ms": approx(-10.0), "speedup": approx(0.0)}
    figures = paper_units.gym_figures({"drift_pct": drifts, "engine_startup": {"engine_awake_gib": 27.5}})
    assert figures["gym_drift_decoding_pct"] == approx(25.0)  # the task that moved most
    assert figures["gym_speedup_drift_decoding_pct"] == approx(-10.0) and figures["gym_neighbour_engine_gib"] == 27.5


def test_an_engine_process_past_its_step_limit_goes_with_its_children(tmp_path, monkeypatch):
    """The step's limit stops the engine's process and what it started (vLLM's engine core process)."""
    import os
    import time

    from checks.gpu.harness import Report

    script = tmp_path / "tree.py"
    pids = tmp_path / "pids"
    script.write_text("import os, subprocess, sys, time\n"
                      "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                      f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
                      "time.sleep(60)\n")
    real_popen = subprocess.Popen
    monkeypatch.setattr(paper_units.subprocess, "Popen",
                        lambda argv, **kwargs: real_popen([sys.executable, str(script)], **kwargs))
    facts = dict.fromkeys(("commit", "date", "device", "driver", "torch", "cuda", "triton", "python"), "x")
    report = Report("paper_units", "t", facts, out=tmp_path)
    report.begin("vllm_batch")
    assert paper_units.step(report, "engine", 3, lambda: paper_units.run_engine_child("batch", {}, False)) is None
    parent, child = map(int, pids.read_text().split())
    time.sleep(0.5)
    for pid in (parent, child):
        try:
            os.kill(pid, 0)
            alive = not open(f"/proc/{pid}/stat").read().split()[2] == "Z"
        except ProcessLookupError:
            alive = False
        assert not alive, pid
    assert report.failures == ["vllm_batch: engine"]


def fake_smoke_run(root: Path, phases: dict[str, float] | list[dict[str, float]], card_line: str = "") -> None:
    """A finished one-GPU smoke as Snakemake leaves it: the RL iteration's train_metrics (one step's, or a list of
    steps') and the jobs' benchmarks."""
    import pandas as pd

    metrics = root / "results/train_metrics/stage=rl/rl-paper-smoke-1gpu/run=drkernel/iter=0"
    metrics.mkdir(parents=True)
    steps = phases if isinstance(phases, list) else [phases]
    pd.DataFrame([{"step": number, "name": name, "value": value} for number, step in enumerate(steps, 1)
                  for name, value in step.items()]).to_parquet(metrics / "part-0.parquet")
    for name, seconds in (("sft-paper-smoke-1gpu.tsv", 100.0), ("rl-paper-smoke-1gpu/drkernel-iter0.tsv", 400.0)):
        (root / "logs/benchmarks" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "logs/benchmarks" / name).write_text(f"s\th:m:s\n{seconds}\t0:00:00\n")
    (root / "logs/rl.log").write_text(card_line)


def smoke_report(tmp_path: Path, phases: dict[str, float], card_line: str = "") -> "Report":
    import argparse

    from checks.gpu.harness import Report

    fake_smoke_run(tmp_path / "run", phases, card_line)
    report = Report("paper_units", "t", dict.fromkeys(("commit", "date", "device"), "x"), out=tmp_path)
    report.begin("rl_step")
    paper_units.rl_step(report, argparse.Namespace(smoke_dir=str(tmp_path / "run"), tiny=False))
    return report


def test_the_rl_step_is_read_from_a_finished_smoke_and_held_to_the_plan(tmp_path):
    """The plan's phases for the smoke's config (no GPU here: an H200's units) against the run's metrics: within
    25 % passes. Where the run counted its rows' tokens, its forward and backward passes are held to the plan's
    trainer at those rows (twice that fails) and read as a rate; without the count, to the plan's own rows."""
    from kpipe.infra.config import load_config
    from kpipe.report.cost import load_units, plan_cost, rl_rows_train_seconds

    config = load_config(*(str(ROOT / name) for name in ("config/config.yaml", *paper_units.SMOKE_CONFIGS)))
    units = load_units(ROOT / "config/cost_units.yaml")
    predicted = next(s for s in plan_cost(config, units, 1, "h200").stages if s.name == "rl").phases
    at_rows = rl_rows_train_seconds(config, units, "h200", 60_000.0, 12.0)
    assert at_rows != pytest.approx(predicted["forward_backward_s"], rel=0.25)  # the plan's rows are others

    def run(forward_backward: float, **extra: float) -> dict[str, float]:
        log_probs, optimizer = 0.2 * forward_backward, predicted["optimizer_s"] * 1.1
        return {"rollout_s": predicted["rollout_s"] * 0.9, "gen_s": predicted["rollout_s"] * 0.9, "eval_s": 0.0,
                "log_probs_s": log_probs, "update_s": forward_backward - log_probs + optimizer, "optimizer_s": optimizer,
                "sleep_wake_s": 0.1, "step_s": predicted["step_s"] * 1.2, "rows": 12.0, "response_tokens_mean": 4096.0,
                "kept_frac_mrs": 1.0, "mismatch_abs_log_w": 0.0, **extra}

    report = smoke_report(tmp_path, run(at_rows, row_tokens=60_000.0))
    assert report.failures == [], report.failures
    assert report.data["phases"]["forward_backward_s"] == pytest.approx(at_rows)
    lines = "\n".join(report.current["lines"])
    assert "| forward_backward_at_rows_s |" in lines and "| forward_backward_s |" in lines and "reported" in lines
    assert f"read at {60_000 / at_rows:,.0f} tokens/s" in lines and "| push_s |" in lines
    assert "rl_validate" in lines and "not run" in lines  # the job comparison of a run stopped at rl_iter

    failures = smoke_report(tmp_path / "slow", run(2 * at_rows, row_tokens=60_000.0)).failures
    assert len(failures) == 1 and failures[0].startswith("rl_step: forward_backward_at_rows_s")
    assert smoke_report(tmp_path / "uncounted", run(predicted["forward_backward_s"])).failures == []
    failures = smoke_report(tmp_path / "uncounted_slow", run(2 * predicted["forward_backward_s"])).failures
    assert len(failures) == 1 and failures[0].startswith("rl_step: forward_backward_s")


def test_each_step_reports_its_push_and_mrs_against_the_engine(tmp_path):
    """The second step starts with the push: its row shows the push's seconds and what MRS kept after it."""
    first = {"rollout_s": 200.0, "log_probs_s": 10.0, "update_s": 40.0, "optimizer_s": 3.0, "sleep_wake_s": 0.03,
             "step_s": 240.0, "rows": 9.0, "row_tokens": 150_000.0, "trained_rows": 7.0, "kept_frac_mrs": 7 / 9,
             "mismatch_abs_log_w": 8e-4}
    second = {**first, "push_s": 0.5, "trained_rows": 9.0, "kept_frac_mrs": 1.0, "mismatch_abs_log_w": 4e-4}
    report = smoke_report(tmp_path, [first, second])
    assert report.data["steps"][1] == {k: v for k, v in first.items() if k in ("sleep_wake_s", "rows", "row_tokens",
                                                                                "trained_rows", "kept_frac_mrs",
                                                                                "mismatch_abs_log_w")}
    assert report.data["steps"][2]["push_s"] == 0.5 and report.data["steps"][2]["kept_frac_mrs"] == 1.0
    lines = "\n".join(report.current["lines"])
    assert "| 1 | - | 0.03 | 9 | 1.5e+05 | 7 | 78% | 0.0008 |" in lines
    assert "| 2 | 0.5 | 0.03 | 9 | 1.5e+05 | 9 | 100% | 0.0004 |" in lines
    assert "the update trained 8.0 of them a step, 133,333 tokens (estimated at the mean row's length)" in lines


def test_the_update_is_held_to_the_rows_it_trained_and_the_log_probs_to_every_row():
    """MRS and PRS drop rows after the log-prob forward: every row is read once, the trained ones three times
    more (forward and backward) a PPO epoch; by hand at one row length, seconds are tokens x FLOPs a token over
    the peak x MFU."""
    from kpipe.infra.config import load_config
    from kpipe.report.cost import architecture_of, load_units, policy_architecture, rl_rows_train_seconds

    config = load_config(*(str(ROOT / name) for name in ("config/config.yaml", *paper_units.SMOKE_CONFIGS)))
    units = load_units(ROOT / "config/cost_units.yaml")
    model = policy_architecture(config)
    shapes, params = architecture_of(model, units), units.models[model].value
    per_pass = 2 * params + 2 * shapes.layers * shapes.attention_width * 20_000  # a 20,000-token row
    rate = units.gpu_kinds["h100"]["peak_bf16_flops"].value * units["training_mfu"]
    every_row = rl_rows_train_seconds(config, units, "h100", 200_000.0, 10.0)
    assert every_row == pytest.approx(200_000 * 4 * per_pass / rate)  # ppo_epochs 1: 1 + 3 passes
    two_trained = rl_rows_train_seconds(config, units, "h100", 200_000.0, 10.0, 40_000.0, 2.0)
    assert two_trained == pytest.approx((200_000 * per_pass + 40_000 * 3 * per_pass) / rate)
    assert rl_rows_train_seconds(config, units, "h100", 200_000.0, 10.0, 0.0, 0.0) == pytest.approx(200_000 * per_pass / rate)
    assert paper_units.trained_rows_read({"rows": 10.0, "row_tokens": 200_000.0, "trained_rows": 2.0}) == (40_000.0, 2.0)
    assert paper_units.trained_rows_read({"rows": 10.0, "row_tokens": 200_000.0, "trained_rows": 2.0,
                                          "trained_row_tokens": 50_000.0}) == (50_000.0, 2.0)
    assert paper_units.trained_rows_read({"rows": 10.0, "row_tokens": 200_000.0}) == ()


def test_the_rl_step_is_reported_only_on_the_card_its_jobs_ran_on(tmp_path):
    from checks.gpu.harness import CheckFailed

    line = "2026-12-07 15:08:24,915 kpipe INFO rule rl_iter: GPU(s) NVIDIA H100 80GB HBM3\n"
    assert paper_units.job_cards(tmp_path) == set()
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs/rl.log").write_text(line)
    assert paper_units.job_cards(tmp_path / "logs") == {"NVIDIA H100 80GB HBM3"}
    with pytest.raises(CheckFailed, match="ran on NVIDIA H100 80GB HBM3, this is cpu"):
        smoke_report(tmp_path / "x", {"rollout_s": 1.0}, line)


def test_the_batch_section_runs_the_engines_it_is_given(tmp_path):
    """vllm_batch --batch-engines standalone: the paper's 8,192-token batch in one engine's time (on the stand-in)."""
    import os

    fake = ROOT / "tests" / "fixtures" / "fake_vllm"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(fake), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "checks.gpu", "paper_units", "vllm_batch", "--tiny", "--batch-engines",
                           "standalone", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    batch = json.loads((tmp_path / "paper_units.json").read_text())["sections"]["vllm_batch"]["data"]
    assert "standalone" in batch and "kpipe_engine" not in batch and "comparison" not in batch
    wrong = subprocess.run([sys.executable, "-m", "checks.gpu", "paper_units", "vllm_batch", "--tiny", "--batch-engines",
                            "standalone,sglang", "--out", str(tmp_path / "wrong")], cwd=ROOT, capture_output=True,
                           text=True, timeout=300, env=env)
    assert wrong.returncode != 0 and "unknown engine(s) sglang" in (tmp_path / "wrong" / "paper_units.md").read_text()


def test_a_batch_split_over_two_calls_compares_with_the_earlier_engine_of_the_same_batch(tmp_path):
    """The paper's 8,192-token batch takes an engine's whole call: a kpipe-only run reads standalone's figures from the
    current report where an earlier call measured them at the same batch, vLLM and card, and nowhere else."""
    spec = {"model": "/tmp/m", "tiny": False, "utilization": 0.9, "max_model_len": 32768, "batch": 256,
            "content_tokens": 1000, "output_tokens": 8192}
    key = paper_units.batch_key(spec, "0.26.0", "NVIDIA H200")
    assert "model" not in key and key["card"] == "NVIDIA H200"
    assert paper_units.batch_key({**spec, "model": "/elsewhere"}, "0.26.0", "NVIDIA H200") == key
    results = tmp_path / "paper_units.json"
    assert paper_units.earlier_batch_engine(results, "standalone", key) is None  # no report yet
    standalone = {"output_tokens_per_s": 3100.0, "kv_capacity_tokens": 791824}
    results.write_text(json.dumps({"sections": {"vllm_batch": {
        "data": {"batch_key": key, "engines": {"standalone": standalone}},
        "facts": {"commit": "abc1234", "date": "2026-12-08 02:00 UTC", "device": "NVIDIA H200"}}}}))
    found = paper_units.earlier_batch_engine(results, "standalone", key)
    assert found == {**standalone, "measured": "commit abc1234, 2026-12-08 02:00 UTC"}
    assert paper_units.earlier_batch_engine(results, "kpipe", key) is None  # not measured then
    for changed in ({"output_tokens": 1024}, {"utilization": 0.5}):
        assert paper_units.earlier_batch_engine(results, "standalone", paper_units.batch_key({**spec, **changed}, "0.26.0",
                                                                                             "NVIDIA H200")) is None
    assert paper_units.earlier_batch_engine(results, "standalone", paper_units.batch_key(spec, "0.26.0", "NVIDIA H100 80GB HBM3")) is None
