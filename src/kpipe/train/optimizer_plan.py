"""Where the trainer keeps its weights, gradients and AdamW state: the `optimizer_offload` setting of RL and
SFT (issue 63), read into one of `kpipe.train.offloaded_adamw.MEMORY_PLANS`.

- ``off``: fp32 weights, gradients and ``torch.optim.AdamW``'s moments on the GPU (the default; what every
  run did before the 8B: 16 bytes a parameter);
- ``fp32``: fp32 weights and gradients on the GPU, the moments in page-locked host memory (``OffloadedAdamW``);
- ``bf16``: the model loaded in bf16 (weights and gradients), the fp32 master and the moments on the host
  (``OffloadedAdamW(master_on_host=True)``);
- ``auto``: the first of those that fits beside the activations (``choose_memory_plan``) in the trainer's
  share of a GPU (`trainer_gpu_bytes`); ``off`` without a GPU.

The offloaded optimizers are built after ``accelerator.prepare(model)`` (they stream to the parameters'
device, and FSDP2 replaces the parameters) and are not handed to accelerate: their state is saved beside
accelerate's (`kpipe.train.checkpoint.save_training_state`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from kpipe.train.offloaded_adamw import MEMORY_PLANS, MemoryPlan, OffloadedAdamW, choose_memory_plan

OPTIMIZER_OFFLOADS = ("off", "auto", "fp32", "bf16")
PLANS = {plan.name: plan for plan in MEMORY_PLANS}
PLAN_OF_SETTING = {"off": "gpu", "fp32": "fp32", "bf16": "bf16"}


def read_offload_setting(values: dict[str, Any]) -> dict[str, Any]:
    """`values` (a config section) with ``optimizer_offload: false`` read as ``"off"``: YAML reads a bare
    ``off`` as false."""
    if values.get("optimizer_offload") is False:
        return {**values, "optimizer_offload": "off"}
    return values


def parameter_count(model_dir: str | Path) -> int:
    """Parameters of the causal LM at `model_dir` (a tied embedding counted once), from its config on the
    meta device: nothing allocated, so the plan can pick the dtype the weights are loaded in."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(param.numel() for param in model.parameters())


def trainer_gpu_bytes(vllm_share: float = 0.0) -> float | None:
    """GPU memory the trainer may plan with: the whole of one GPU (total, not free: the same card gives
    the same plan, so a saved state always fits the next attempt's optimizer), less a colocated vLLM
    engine's `gpu_memory_utilization` share, which it holds for the whole job. None without a GPU."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory * (1.0 - vllm_share)


def candidate_plans(setting: str) -> tuple[MemoryPlan, ...]:
    """The plans `setting` (one of OPTIMIZER_OFFLOADS) allows: all of them for ``auto``, else the one it names
    (``kpipe plan --cost`` also chooses among these, and refuses a named plan that does not fit)."""
    if setting not in OPTIMIZER_OFFLOADS:
        raise ValueError(f"optimizer_offload must be one of {OPTIMIZER_OFFLOADS}, not {setting!r}")
    return tuple(MEMORY_PLANS) if setting == "auto" else (PLANS[PLAN_OF_SETTING[setting]],)


def resolve_memory_plan(setting: str, model_dir: str | Path, processes: int, gpu_bytes: float | None) -> MemoryPlan:
    """The plan `setting` (one of OPTIMIZER_OFFLOADS) names; ``auto`` chooses for the model at `model_dir`
    sharded over `processes` GPUs of `gpu_bytes` each (None: no GPU, plan ``gpu``: AdamW beside the CPU model)."""
    plans = candidate_plans(setting)
    if len(plans) == 1:
        return plans[0]
    if gpu_bytes is None:
        return PLANS["gpu"]
    return choose_memory_plan(parameter_count(model_dir), processes, gpu_bytes, plans)


def weights_dtype(plan: MemoryPlan) -> torch.dtype:
    """The dtype the model's own parameters are loaded in: bf16 when the fp32 master lives on the host."""
    return torch.bfloat16 if plan.name == "bf16" else torch.float32


def is_offloaded(optimizer: Any) -> bool:
    """Whether `optimizer` keeps its state outside accelerate's checkpoint (an OffloadedAdamW)."""
    return isinstance(optimizer, OffloadedAdamW)


def build_optimizer(plan: MemoryPlan, params: Iterable[torch.Tensor], lr: float, betas: tuple[float, float],
                    weight_decay: float) -> torch.optim.Optimizer:
    """AdamW for `plan`: torch's (fused on GPU) for ``gpu``; OffloadedAdamW otherwise, built on parameters
    already on their device (after ``accelerator.prepare(model)``)."""
    if plan.name == "gpu":
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay,
                                 fused=torch.cuda.is_available())
    return OffloadedAdamW(params, lr=lr, betas=betas, weight_decay=weight_decay,
                          master_on_host=plan.name == "bf16")


def prepare_model_and_optimizer(accelerator: Any, model: Any, plan: MemoryPlan, lr: float,
                                betas: tuple[float, float], weight_decay: float) -> tuple[Any, Any]:
    """The prepared model and its optimizer. AdamW goes through ``prepare`` with the model (FSDP2 rebuilds
    the parameters and the optimizer must hold the new ones); an OffloadedAdamW is built on the prepared
    model's parameters and stays outside accelerate (no fp16 loss scaling: bf16 or fp32 only)."""
    if plan.name == "gpu":
        return accelerator.prepare(model, build_optimizer(plan, model.parameters(), lr, betas, weight_decay))
    if accelerator.mixed_precision == "fp16":
        raise ValueError(f"optimizer_offload {plan.name!r} does not support fp16 mixed precision (no loss scaler "
                         "steps an OffloadedAdamW): use bf16")
    model = accelerator.prepare(model)
    return model, build_optimizer(plan, model.parameters(), lr, betas, weight_decay)
