"""The ``bf16`` memory plan (an 80 GB GPU: bf16 weights on the GPU, the fp32 master on the host) hands the
fp32 master from stage to stage. Before, the RL trainer built its master from the bf16 weights it loaded, and
SFT exported the GPU's bf16 copy: every update below bf16's step (lr 1e-6) was lost at each hand-off."""

from __future__ import annotations

import json

import torch
from accelerate import Accelerator
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from kpipe.train.checkpoint import export_hf, saved_weights_dtype
from kpipe.train.tiny_model import build_tiny_model
from kpipe.train.trainer_memory import PLANS, prepare_model_and_optimizer


def fp32_weights(model_dir) -> dict[str, torch.Tensor]:
    return {name: tensor for path in sorted(model_dir.glob("*.safetensors")) for name, tensor in load_file(path).items()}


def test_an_fp32_checkpoint_reaches_the_bf16_plans_master_and_its_export(tmp_path):
    source = build_tiny_model(tmp_path / "sft", size="nano", dtype=torch.float32)
    written = fp32_weights(source)
    assert any(not torch.equal(t, t.to(torch.bfloat16).float()) for t in written.values())  # below bf16's step

    accelerator = Accelerator(cpu=True)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    model, optimizer = prepare_model_and_optimizer(accelerator, model, PLANS["bf16"], 1e-6, (0.9, 0.999), 0.0, source)
    masters = dict(zip([name for name, _ in model.named_parameters()], optimizer.master_weights()))
    for name, master in masters.items():
        assert torch.equal(master, written[name]), name  # the master is the checkpoint's fp32, not the bf16 load

    out = export_hf(accelerator, model, AutoTokenizer.from_pretrained(source), tmp_path / "export", optimizer=optimizer)
    assert saved_weights_dtype(out) == torch.float32
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    exported = fp32_weights(out)
    for name in masters:
        assert torch.equal(exported[name], written[name]), name
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)  # HF reads the sharded export
    for name, param in reloaded.named_parameters():
        assert torch.equal(param.detach(), written[name]), name

    unseeded = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    _, plain = prepare_model_and_optimizer(accelerator, unseeded, PLANS["bf16"], 1e-6, (0.9, 0.999), 0.0)
    assert not all(torch.equal(m, written[n]) for n, m in zip([n for n, _ in unseeded.named_parameters()], plain.master_weights()))
