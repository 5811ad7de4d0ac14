"""Training checkpoints: HF-format model + tokenizer, plus the full training state to resume.

Layout of one checkpoint, ``<ckpt_root>/step-000120/``:

- ``model/``  the model in Hugging Face format with its tokenizer (loadable by vLLM and
  ``AutoModelForCausalLM``, the thing later stages consume);
- ``state/``  ``accelerator.save_state``: model, optimizer, scheduler, every process's RNG
  (sharded under FSDP); with an offloaded optimizer (``optimizer_offload``) its host state beside
  them, one ``offloaded_adamw-<process>.pt`` a process (`save_training_state`);
- ``trainer_state.json``  step and the run's restart key (``kpipe.infra.provenance.restart_key``:
  settings, data, code, weights, libraries), written last.

A checkpoint is written into ``.tmp-step-000120`` and renamed into place only once complete,
so a kill during a save leaves the previous checkpoint as the latest one.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kpipe.infra.provenance import key_changes
from kpipe.train.trainer_memory import is_offloaded, master_by_name

STEP_PREFIX = "step-"
TRAINER_STATE = "trainer_state.json"


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    key: dict[str, str] | None  # None: written before restart keys had parts

    def mismatch(self, key: dict[str, str]) -> str:
        """Why this checkpoint cannot be resumed under `key` ("" when it can)."""
        return key_changes(self.key, key)

    @property
    def model_dir(self) -> Path:
        return self.path / "model"

    @property
    def state_dir(self) -> Path:
        return self.path / "state"


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:06d}"


def list_checkpoints(root: str | Path) -> list[Checkpoint]:
    """Complete checkpoints under `root` (those whose trainer_state.json exists), oldest first."""
    root = Path(root)
    found = []
    for path in root.glob(f"{STEP_PREFIX}*") if root.exists() else []:
        state_file = path / TRAINER_STATE
        if path.is_dir() and state_file.exists():
            state = json.loads(state_file.read_text())
            found.append(Checkpoint(path, int(state["step"]), state.get("key")))
    return sorted(found, key=lambda c: c.step)


def latest_checkpoint(root: str | Path) -> Checkpoint | None:
    checkpoints = list_checkpoints(root)
    return checkpoints[-1] if checkpoints else None


def offloaded_state_file(state_dir: str | Path, process_index: int) -> Path:
    return Path(state_dir) / f"offloaded_adamw-{process_index}.pt"


def save_training_state(accelerator: Any, optimizer: Any, state_dir: str | Path) -> None:
    """``accelerator.save_state`` (every process calls it), and an OffloadedAdamW's state, which accelerate
    does not hold (kpipe.train.trainer_memory), one file a process."""
    accelerator.save_state(str(state_dir))
    if is_offloaded(optimizer):
        torch.save(optimizer.state_dict(), offloaded_state_file(state_dir, accelerator.process_index))


def load_training_state(accelerator: Any, optimizer: Any, state_dir: str | Path) -> None:
    """Restore what `save_training_state` wrote into the same kind of optimizer; a state of the other
    kind (another `optimizer_offload` plan) is refused by name. The offloaded state is memory-mapped and
    copied once into the optimizer's page-locked memory: no second copy of it in host memory."""
    state_dir = Path(state_dir)
    offloaded_file = offloaded_state_file(state_dir, accelerator.process_index)
    if is_offloaded(optimizer) != offloaded_file.exists():
        saved = "an offloaded optimizer (OffloadedAdamW)" if offloaded_file.exists() else "torch.optim.AdamW"
        wanted = "an offloaded optimizer" if is_offloaded(optimizer) else "torch.optim.AdamW"
        raise ValueError(f"the training state in {state_dir} was written by {saved}, this run uses {wanted}: "
                         "set optimizer_offload as the run that wrote it did (the plan it chose: off, fp32 or bf16)")
    accelerator.load_state(str(state_dir))
    if is_offloaded(optimizer):
        optimizer.load_state_dict(torch.load(offloaded_file, map_location="cpu", mmap=True, weights_only=True))


def save_checkpoint(accelerator: Any, model: Any, optimizer: Any, tokenizer: Any, root: str | Path, step: int,
                    key: dict[str, str], keep_last: int) -> Path:
    """Write a complete checkpoint for `step` (all processes call this), then prune to `keep_last`."""
    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{step_dir_name(step)}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    save_training_state(accelerator, optimizer, tmp / "state")
    export_hf(accelerator, model, tokenizer, tmp / "model")
    accelerator.wait_for_everyone()  # every rank's RNG state is in tmp before rank 0 renames it
    if accelerator.is_main_process:
        (tmp / TRAINER_STATE).write_text(json.dumps({"step": step, "key": key}))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        prune_checkpoints(root, keep_last)
    accelerator.wait_for_everyone()
    return final


def export_hf(accelerator: Any, model: Any, tokenizer: Any, out_dir: str | Path,
              dtype: torch.dtype | None = None, optimizer: Any = None) -> Path:
    """Save the (possibly FSDP-sharded) model as one HF-format directory with its tokenizer, its floating
    weights cast to `dtype` (None: as they are). A bf16 export is for readers that sample in bf16 anyway (vLLM,
    evaluation): a trainer must not start from one (`check_trainer_init`). Where `optimizer` keeps the fp32
    master on the host (the ``bf16`` memory plan, one GPU), its master is what is saved, in fp32 unless
    `dtype` says otherwise: the GPU's bf16 copy has lost the updates smaller than bf16's step (lr 1e-6)."""
    out_dir = Path(out_dir)
    state_dict = accelerator.get_state_dict(model)
    master = host_master_by_name(accelerator, model, optimizer)
    if master:
        weights = {name: master.get(name, tensor) for name, tensor in state_dict.items()}
        save_tensors_in_shards(accelerator.unwrap_model(model), weights, out_dir, dtype or torch.float32)
        tokenizer.save_pretrained(out_dir)
        return out_dir
    if dtype is not None and state_dict is not None:  # None on the processes that do not save (FSDP)
        state_dict = {name: tensor.to(dtype) if tensor.is_floating_point() else tensor
                      for name, tensor in state_dict.items()}
    accelerator.unwrap_model(model).save_pretrained(
        out_dir, state_dict=state_dict, is_main_process=accelerator.is_main_process, save_function=accelerator.save
    )
    if accelerator.is_main_process:
        tokenizer.save_pretrained(out_dir)
        if dtype is not None:  # save_pretrained writes the model's own dtype, not the state dict's
            config_file = out_dir / "config.json"
            config = json.loads(config_file.read_text())
            config["dtype"] = str(dtype).removeprefix("torch.")
            config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir


SHARD_BYTES = 4 << 30


def save_tensors_in_shards(model: Any, tensors: dict[str, torch.Tensor], out_dir: Path, dtype: torch.dtype) -> None:
    """`tensors` (floating ones cast to `dtype`) as HF's sharded safetensors (``model-0000K-of-0000N`` files
    and their index) beside the model's config, one tensor copied at a time: the host master's tensors are
    views of one allocation, which ``save_pretrained`` takes for tied weights and drops, and a whole copy of
    an 8B master (32 GB) would not fit beside it on a 128 GiB host."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out_dir)
    config = json.loads((out_dir / "config.json").read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out_dir)
    shards: list[list[str]] = [[]]
    sizes = [0]
    for name, tensor in tensors.items():  # group the names into shards of at most SHARD_BYTES
        nbytes = tensor.numel() * (dtype.itemsize if tensor.is_floating_point() else tensor.element_size())
        if shards[-1] and sizes[-1] + nbytes > SHARD_BYTES:
            shards.append([])
            sizes.append(0)
        shards[-1].append(name)
        sizes[-1] += nbytes
    weight_map = {}
    for index, names in enumerate(shards, 1):
        filename = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file({name: (tensors[name].to(dtype) if tensors[name].is_floating_point() else tensors[name]).detach().cpu().clone()
                   for name in names}, str(out_dir / filename), metadata={"format": "pt"})
        weight_map |= {name: filename for name in names}
    index_file = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=2, sort_keys=True) + "\n")


def host_master_by_name(accelerator: Any, model: Any, optimizer: Any) -> dict[str, torch.Tensor]:
    """The fp32 host master of an OffloadedAdamW with ``master_on_host``, by parameter name (empty without
    one). One process only: under FSDP2 each process holds the master of its own shards."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps it
    if not (is_offloaded(inner) and inner.master_on_host):
        return {}
    if accelerator.num_processes > 1:
        raise ValueError("exporting the host's fp32 master under FSDP2 is not supported: use the fp32 memory plan "
                         "(rl.optimizer_offload / sft.optimizer_offload) on several GPUs")
    return master_by_name(inner, accelerator.unwrap_model(model))


def saved_weights_dtype(model_dir: str | Path) -> torch.dtype:
    """The dtype of the floating weights of an HF safetensors checkpoint, read from the files' headers only."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors weights in {model_dir}")
    with safe_open(str(files[0]), framework="pt") as handle:
        dtypes = {handle.get_slice(name).get_dtype() for name in handle.keys()}
    floating = sorted(name for name in dtypes if name.startswith(("F", "BF")))
    if len(floating) != 1:
        raise ValueError(f"{model_dir}: expected one floating dtype in its weights, found {floating}")
    return {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[floating[0]]


def check_trainer_init(model_dir: str | Path, weights_dtype: torch.dtype) -> None:
    """Refuse to train from a checkpoint saved narrower than the trainer's weights: an fp32 trainer at lr 1e-6
    from a bf16 round trip of the previous stage would start from weights its updates no longer show in."""
    saved = saved_weights_dtype(model_dir)
    if saved.itemsize < weights_dtype.itemsize:
        raise ValueError(f"{model_dir} holds {saved} weights, the trainer {weights_dtype}: it is an evaluation-only "
                         "export (rl.final_checkpoint: evaluation of a run's last iteration); rerun the job that "
                         "wrote it as a trainer checkpoint (raising rl.iterations does)")


def prune_checkpoints(root: str | Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete checkpoints, and any leftover partial saves."""
    root = Path(root)
    for stale in root.glob(f".tmp-{STEP_PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)
    checkpoints = list_checkpoints(root)
    for old in checkpoints[: max(0, len(checkpoints) - keep_last)]:
        shutil.rmtree(old.path, ignore_errors=True)


def remove_checkpoints(root: str | Path) -> None:
    """Drop every checkpoint under `root` (another run's, or a finished run's: never resumed)."""
    for checkpoint in list_checkpoints(root):
        shutil.rmtree(checkpoint.path, ignore_errors=True)
