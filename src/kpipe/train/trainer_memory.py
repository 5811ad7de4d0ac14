"""How the trainer fits one GPU's memory at the paper's shapes (issue 63): log-probs and entropy through
the LM head in chunks, and AdamW with its moments (optionally the fp32 master) in host memory. One module,
because both answer one question: where the 8B's bytes live while it trains.

**Log-probs in chunks.**

At the paper's shapes the full logits are 32,768 tokens x 151,936 rows: 18.5 GiB in fp32, doubled by
their gradient, which is what HF's ``labels=`` loss builds. Here the forward keeps only one chunk's
logits at a time and saves nothing of them; the backward recomputes each chunk's logits and writes
the gradients of the hidden states and of the head directly, so memory grows with ``chunk_tokens x
vocab`` instead of ``tokens x vocab``.

Derivatives, with z the logits of one token, p = softmax(z), lp = log p, H = -sum p lp:
d lp[target] / dz = onehot(target) - p, and dH / dz = -p (lp + H).

---

**AdamW with its moments in host memory**, for full-parameter training of the 8B on one GPU.

fp32 weights, gradients and AdamW's two moments are 16 bytes a parameter: 122 GiB at 8B, more than an
H100 holds and most of an H200. This optimizer keeps the moments (8 bytes a parameter) in pinned host
memory and streams them through the GPU in buckets: while the GPU updates one bucket, the next is copied
in and the previous one copied out, on two copy streams (host-to-device and device-to-host run at once
over PCIe). The update itself is AdamW's arithmetic on the GPU, op for op what ``torch.optim.AdamW``'s
foreach path does, so the two agree to rounding.

``master_on_host`` also moves the fp32 master weights to the host (12 bytes a parameter there): the
model's own parameters can then be bf16 (an H100's plan: bf16 weights and gradients on the GPU, 4 bytes
a parameter), and after each update the master is cast into them.

Why the update runs on the GPU and not the CPU: a CPU AdamW step over 8.2e9 parameters reads and writes
~130 GB of host memory on 16 cores (tens of seconds), while the GPU's part is milliseconds and the copies
move 2 x 65 GB over a link that carries both directions at once (docs/gpu-results/paper_units.md measures it).

The memory plans (`MEMORY_PLANS`, `choose_memory_plan`) say where a trainer keeps its 16 bytes a parameter;
the module's last section reads RL's and SFT's `optimizer_offload` setting into one and builds its optimizer.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

DEFAULT_CHUNK_TOKENS = 2048  # 2,048 x 151,936 fp32 logits are 1.2 GiB a temporary
# config attributes of HF models whose logits are not hidden @ head.weight.T: the chunked path refuses them
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def _statistics_dtype(matmul_dtype: torch.dtype) -> torch.dtype:
    """Softmax and accumulations in fp32 at least (float64 stays float64: the exactness tests)."""
    return torch.promote_types(matmul_dtype, torch.float32)


def _chunk_statistics(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                      temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-probs of the targets, entropies, fp32 log-softmax, fp32 probabilities) of one chunk."""
    logits = (hidden @ weight.t()).to(torch.promote_types(hidden.dtype, torch.float32)) / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    probs = log_probs.exp()
    entropy = -(probs * log_probs).sum(-1)
    return log_probs.gather(-1, targets[:, None]).squeeze(-1), entropy, log_probs, probs


class _ChunkedLogprobsEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                chunk_tokens: int, temperature: float, matmul_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast(hidden.device.type, enabled=False):
            cast_weight = weight.to(matmul_dtype)
            token_logprobs = torch.empty(hidden.shape[0], dtype=_statistics_dtype(matmul_dtype),
                                         device=hidden.device)
            entropies = torch.empty_like(token_logprobs)
            for start in range(0, hidden.shape[0], chunk_tokens):
                end = start + chunk_tokens
                token_logprobs[start:end], entropies[start:end], _, _ = _chunk_statistics(
                    hidden[start:end].to(matmul_dtype), cast_weight, targets[start:end], temperature)
        ctx.save_for_backward(hidden, weight, targets, entropies)
        ctx.set_materialize_grads(False)  # an output the loss does not use (the entropy) costs no backward work
        ctx.chunk_tokens, ctx.temperature, ctx.matmul_dtype = chunk_tokens, temperature, matmul_dtype
        return token_logprobs, entropies

    @staticmethod
    def backward(ctx: Any, grad_logprobs: torch.Tensor | None,
                 grad_entropies: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, targets, entropies = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=_statistics_dtype(ctx.matmul_dtype), device=weight.device) \
            if ctx.needs_input_grad[1] else None
        with torch.autocast(hidden.device.type, enabled=False):
            cast_weight = weight.to(ctx.matmul_dtype)
            for start in range(0, hidden.shape[0], ctx.chunk_tokens):
                end = start + ctx.chunk_tokens
                chunk = hidden[start:end].to(ctx.matmul_dtype)
                _, _, log_probs, probs = _chunk_statistics(chunk, cast_weight, targets[start:end], ctx.temperature)
                grad_logits = torch.zeros_like(probs)
                if grad_logprobs is not None:
                    upstream = grad_logprobs[start:end, None]
                    grad_logits -= upstream * probs
                    grad_logits.scatter_add_(-1, targets[start:end, None], upstream)
                if grad_entropies is not None:
                    grad_logits -= grad_entropies[start:end, None] * probs * (log_probs + entropies[start:end, None])
                grad_logits = (grad_logits / ctx.temperature).to(ctx.matmul_dtype)
                if grad_hidden is not None:
                    grad_hidden[start:end] = (grad_logits @ cast_weight).to(hidden.dtype)
                if grad_weight is not None:
                    grad_weight += grad_logits.t() @ chunk
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def token_logprobs_and_entropy(hidden: torch.Tensor, lm_head_weight: torch.Tensor, targets: torch.Tensor,
                               chunk_tokens: int = DEFAULT_CHUNK_TOKENS, temperature: float = 1.0,
                               matmul_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target token and the entropy of each token's distribution (fp32 or wider,
    shaped like `targets`), from the final hidden states (`targets.shape + (hidden,)`) and the LM head's
    weight (vocab x hidden), with gradients for both and no full tokens x vocab tensor.

    `temperature` divides the logits (the sampler's temperature, as RL log-probs use); `matmul_dtype`
    is the dtype of the head's matmuls (default: the hidden states'), e.g. bf16 for fp32 master weights.
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} does not match targets {tuple(targets.shape)} "
                         f"(expected targets.shape + (hidden_size,))")
    if lm_head_weight.ndim != 2 or lm_head_weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"lm_head_weight {tuple(lm_head_weight.shape)} is not (vocab, {hidden.shape[-1]})")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, not {chunk_tokens}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, not {temperature}")
    flat_logprobs, flat_entropies = _ChunkedLogprobsEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), lm_head_weight, targets.reshape(-1).long(), chunk_tokens,
        temperature, matmul_dtype or hidden.dtype)
    return flat_logprobs.view(targets.shape), flat_entropies.view(targets.shape)


def lm_head_weight(model: Any) -> torch.Tensor:
    """The LM head's weight of a Hugging Face causal LM (the input embedding's, when tied: one parameter,
    which then gets both gradients). Refuses a head whose logits are not ``hidden @ weight.T``: a bias,
    or logits scaled or soft-capped by the config (`LOGIT_TRANSFORMS`)."""
    head = model.get_output_embeddings()
    if head is None or getattr(head, "weight", None) is None:
        raise ValueError(f"{type(model).__name__} has no LM head (get_output_embeddings) to compute log-probs in chunks")
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"{type(model).__name__}'s LM head has a bias: chunked log-probs compute hidden @ weight.T only")
    transforms = [name for name in LOGIT_TRANSFORMS if getattr(model.config, name, None) not in (None, 1, 1.0)]
    if transforms:
        raise ValueError(f"{type(model).__name__} transforms its logits ({', '.join(transforms)}): "
                         "chunked log-probs compute hidden @ weight.T only")
    return head.weight


def head_is_sharded(model: Any) -> bool:
    """Whether the LM head's weight is an FSDP2 shard (a DTensor): outside the root unit's forward it is
    not the whole matrix, so the chunked path cannot use it."""
    from torch.distributed.tensor import DTensor

    return isinstance(lm_head_weight(model), DTensor)


def effective_chunk_tokens(model: Any, chunk_tokens: int) -> int:
    """`chunk_tokens`, or 0 (the model's own logits) where the LM head's weight is an FSDP2 shard: the
    chunked path reads the head's weight outside the model's forward, where FSDP2 has not gathered it."""
    if chunk_tokens and head_is_sharded(model):
        log.warning("logprob_chunk_tokens %d: the LM head is FSDP2-sharded, so log-probs use the model's own "
                    "logits (kpipe.train.trainer_memory.effective_chunk_tokens)", chunk_tokens)
        return 0
    return chunk_tokens


def model_token_logprobs_and_entropy(model: Any, inputs: dict[str, torch.Tensor], positions: torch.Tensor | slice,
                                     targets: torch.Tensor, chunk_tokens: int,
                                     temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs_and_entropy` of an HF causal LM: the decoder's final hidden states (`inputs` as the
    model takes them) at sequence `positions`, each predicting `targets` ([batch, len(positions)]), through
    the LM head in chunks. The matmuls run in the autocast dtype when autocast is on (bf16 over fp32
    master weights), else in the hidden states' dtype."""
    weight = lm_head_weight(model)
    hidden = model.get_decoder()(**inputs, use_cache=False).last_hidden_state[:, positions]
    device_type = hidden.device.type
    matmul_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    return token_logprobs_and_entropy(hidden, weight, targets, chunk_tokens, temperature, matmul_dtype)


# 64 M elements: 256 MB a state row a bucket, the width of the two staging slots on the GPU. A parameter larger
# than the room left in a bucket is cut across buckets: whole, the 8B's embedding and untied LM head (151,936 x
# 4096 = 622 M each) would set the slots' width, 2 x 3 x 622 M x 4 B = 14.9 GB of GPU memory under the bf16 plan.
DEFAULT_BUCKET_NUMEL = 1 << 26


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's shard of an FSDP2 (DTensor) parameter or gradient; a plain tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@dataclass(frozen=True, eq=False)
class _Span:
    """Elements [offset, offset + numel) of one parameter's flattened local tensor: a bucket's share of it."""

    param: torch.Tensor
    offset: int
    numel: int

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """The same elements of `tensor`, the parameter or its gradient (a view: both are contiguous)."""
        return _local(tensor).view(-1)[self.offset:self.offset + self.numel]


@dataclass
class _Bucket:
    """Slices of parameters updated together, and their columns [start, end) of the host state."""

    spans: list[_Span]
    start: int
    end: int
    group_index: int  # of `param_groups`, looked up at each step: a scheduler or a loaded state replaces values
    steps: int = 0  # every slice of a parameter has a gradient at a step or none has: each bucket counts its own


def _pin(tensor: torch.Tensor, owner: object) -> None:
    """Page-lock a host tensor in place (cudaHostRegister), unregistered when `owner` is collected.

    Not ``pin_memory()``: PyTorch's pinned allocator rounds every block up to a power of two, 34 GB for a
    state of 32.8 GB; registering the exact allocation costs nothing extra."""
    cudart = torch.cuda.cudart()
    error = cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)
    if int(error) != 0:
        raise RuntimeError(f"cudaHostRegister of {tensor.numel() * tensor.element_size() / 2**30:.1f} GiB failed "
                           f"({error}): not enough lockable host memory")
    # the finalizer holds the tensor: its memory stays allocated until it is unregistered
    weakref.finalize(owner, lambda pinned: cudart.cudaHostUnregister(pinned.data_ptr()), tensor)


class OffloadedAdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` (decoupled weight decay, no amsgrad) with its state in host memory.

    The parameters stay where they are (the GPU); their gradients must be there too. Under FSDP2 each process
    keeps and steps the state of its own shards (the DTensors' local tensors). Buckets hold at most
    `bucket_numel` elements, filled in parameter order: a larger parameter is cut into slices of its
    flattened (contiguous) tensor, so the 8B's embedding and head (622 M each) do not set the width of
    the GPU's staging slots. Every parameter that requires a gradient is updated at each step: a bucket
    whose slices have no gradient at all is skipped, one where only some have is refused (its moments
    are stepped together)."""

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2, *,
                 master_on_host: bool = False, bucket_numel: int = DEFAULT_BUCKET_NUMEL) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= beta < 1 for beta in betas):
            raise ValueError(f"invalid AdamW hyper-parameters: lr {lr}, betas {betas}, eps {eps}, "
                             f"weight_decay {weight_decay}")
        if bucket_numel < 1:
            raise ValueError(f"bucket_numel must be at least 1, not {bucket_numel}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        # the parameters it updates, in order; each one's columns of the host state start at `_starts`
        self.params = [param for group in self.param_groups for param in group["params"] if param.requires_grad]
        if not self.params:
            raise ValueError("OffloadedAdamW got no parameter that requires a gradient")
        self.device = self.params[0].device
        if any(param.device != self.device for param in self.params):
            raise ValueError("OffloadedAdamW's parameters must all be on one device")
        strided = [tuple(_local(param).shape) for param in self.params if not _local(param).is_contiguous()]
        if strided:
            raise ValueError(f"OffloadedAdamW steps slices of each parameter's flattened tensor: parameters of "
                             f"shapes {strided} are not contiguous")
        self.master_on_host = master_on_host
        self._starts = list(itertools.accumulate((_local(param).numel() for param in self.params), initial=0))
        self.buckets = self._make_buckets(bucket_numel)
        # rows: exp_avg, exp_avg_sq[, fp32 master]; one allocation, page-locked once where there is a GPU
        self.host_state = torch.zeros(3 if master_on_host else 2, self._starts[-1], dtype=torch.float32)
        if master_on_host:
            for param, master in zip(self.params, self.master_weights(), strict=True):
                master.copy_(_local(param).detach())
        self.streamed = self.device.type == "cuda"
        if self.streamed:
            _pin(self.host_state, self)
            self._copy_in, self._copy_out = torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)
        widest = max((bucket.end - bucket.start for bucket in self.buckets), default=0)
        self._slots = [torch.empty(self.host_state.shape[0], widest, dtype=torch.float32, device=self.device)
                       for _ in range(2)]
        self.last_step_bytes = 0  # host<->device bytes the last step copied (both directions)

    def _make_buckets(self, bucket_numel: int) -> list[_Bucket]:
        """Buckets of at most `bucket_numel` elements over the host state's columns in parameter order, each
        filled before the next begins (a parameter cut where the room ends), and none across two groups."""
        buckets: list[_Bucket] = []
        start = 0
        for group_index, group in enumerate(self.param_groups):
            spans: list[_Span] = []
            size = 0
            for param in (p for p in group["params"] if p.requires_grad):
                numel, offset = _local(param).numel(), 0
                while offset < numel:
                    length = min(numel - offset, bucket_numel - size)
                    spans.append(_Span(param, offset, length))
                    offset += length
                    size += length
                    if size == bucket_numel:
                        buckets.append(_Bucket(spans, start, start + size, group_index))
                        start, spans, size = start + size, [], 0
            if spans:
                buckets.append(_Bucket(spans, start, start + size, group_index))
                start += size
        return buckets

    @staticmethod
    def _views(rows: torch.Tensor, bucket: _Bucket) -> list[list[torch.Tensor]]:
        """Each state row of a staged bucket cut into its spans' slices (flat: AdamW is elementwise)."""
        return [list(row.split([span.numel for span in bucket.spans])) for row in rows]

    def _stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream) if self.streamed else contextlib.nullcontext()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compute = torch.cuda.current_stream(self.device) if self.streamed else None
        slot_free: list[Any] = [None, None]
        moved = 0
        for index, bucket in enumerate(self.buckets):
            grads = [None if span.param.grad is None else span.of(span.param.grad) for span in bucket.spans]
            if all(grad is None for grad in grads):
                continue
            if any(grad is None for grad in grads):
                raise ValueError("OffloadedAdamW: some parameters of a bucket have no gradient; it updates "
                                 "every parameter that requires one at each step")
            bucket.steps += 1
            width = bucket.end - bucket.start
            staged = self._slots[index % 2][:, :width]
            with self._stream(self._copy_in if self.streamed else None):
                if slot_free[index % 2] is not None:
                    self._copy_in.wait_event(slot_free[index % 2])
                for row, host_row in zip(staged, self.host_state):
                    row.copy_(host_row[bucket.start:bucket.end], non_blocking=True)
            if self.streamed:
                compute.wait_stream(self._copy_in)
            views = self._views(staged, bucket)
            exp_avgs, exp_avg_sqs = views[0], views[1]
            if self.master_on_host:
                targets = views[2]
                grads = [grad.float() for grad in grads]
            else:
                targets = [span.of(span.param) for span in bucket.spans]
            self._adamw(targets, grads, exp_avgs, exp_avg_sqs, bucket.steps, self.param_groups[bucket.group_index])
            if self.master_on_host:
                torch._foreach_copy_([span.of(span.param) for span in bucket.spans], targets)
            with self._stream(self._copy_out if self.streamed else None):
                if self.streamed:
                    self._copy_out.wait_stream(compute)
                for row, host_row in zip(staged, self.host_state):
                    host_row[bucket.start:bucket.end].copy_(row, non_blocking=True)
                if self.streamed:
                    slot_free[index % 2] = self._copy_out.record_event()
            moved += 2 * staged.numel() * staged.element_size()
        if self.streamed:
            self._copy_out.synchronize()  # the host state is whole before anyone reads it or steps again
        self.last_step_bytes = moved
        return loss

    @staticmethod
    def _adamw(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
               exp_avg_sqs: list[torch.Tensor], step: int, group: dict[str, Any]) -> None:
        """AdamW's update, in the order of ``torch.optim.AdamW``'s own implementation."""
        beta1, beta2 = group["betas"]
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        torch._foreach_mul_(params, 1 - lr * weight_decay)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        step_size = lr / (1 - beta1 ** step)
        denominators = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denominators, math.sqrt(1 - beta2 ** step))
        torch._foreach_add_(denominators, eps)
        torch._foreach_addcdiv_(params, exp_avgs, denominators, -step_size)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The hyper-parameters (torch's `param_groups`), the host state (moments, and the fp32 master with
        `master_on_host`; the tensor itself, not a copy: 8 or 12 bytes a parameter) and each bucket's step
        count. This process's shards only under FSDP2: one state a process."""
        return {"param_groups": super().state_dict()["param_groups"], "host_state": self.host_state,
                "bucket_layout": [(bucket.start, bucket.end) for bucket in self.buckets],
                "bucket_steps": [bucket.steps for bucket in self.buckets], "master_on_host": self.master_on_host}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore what `state_dict` saved, into the page-locked host state (a memory-mapped load's pages
        are copied once); with `master_on_host` the parameters become the restored master's cast. A state of
        other buckets is refused: one saved before buckets cut parameters (whole parameters a bucket) too."""
        if "host_state" not in state_dict:
            raise ValueError("OffloadedAdamW.load_state_dict: not an OffloadedAdamW state (no host_state); "
                             "a torch.optim.AdamW state cannot be loaded into it")
        layout = [tuple(span) for span in state_dict["bucket_layout"]]
        if state_dict["master_on_host"] != self.master_on_host or layout != [(b.start, b.end) for b in self.buckets] \
                or tuple(state_dict["host_state"].shape) != tuple(self.host_state.shape):
            raise ValueError(f"OffloadedAdamW.load_state_dict: the state was saved for another layout (master on host "
                             f"{state_dict['master_on_host']}, host state {tuple(state_dict['host_state'].shape)}), "
                             f"not this optimizer's (master on host {self.master_on_host}, host state "
                             f"{tuple(self.host_state.shape)}, the same buckets)")
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        self.host_state.copy_(state_dict["host_state"])
        for bucket, steps in zip(self.buckets, state_dict["bucket_steps"], strict=True):
            bucket.steps = int(steps)
        if self.master_on_host:
            with torch.no_grad():
                for param, master in zip(self.params, self.master_weights(), strict=True):
                    _local(param).copy_(master)

    def master_weights(self) -> list[torch.Tensor]:
        """The fp32 weights AdamW updates, in parameter order: with `master_on_host`, views of the host master
        shaped like each (local) parameter (a parameter's columns are adjacent even where buckets cut it),
        else the parameters themselves."""
        if not self.master_on_host:
            return list(self.params)
        return [self.host_state[2, start:start + _local(param).numel()].view(_local(param).shape)
                for param, start in zip(self.params, self._starts)]


@dataclass(frozen=True)
class MemoryPlan:
    """Where the trainer keeps its 16 bytes a parameter of weights, gradients and AdamW state."""

    name: str
    gpu_bytes_per_param: int  # weights and gradients (and moments, "gpu") on the GPUs, before sharding
    host_bytes_per_param: int  # page-locked host memory: the moments (and the fp32 master, "bf16")
    resident_bytes_per_param: int  # left on the GPUs while a colocated engine decodes (gradients freed)
    optimizer: str  # what steps it


MEMORY_PLANS = (
    MemoryPlan("gpu", 16, 0, 12, "torch.optim.AdamW"),  # fp32 weights, gradients and moments on the GPUs
    MemoryPlan("fp32", 8, 8, 4, "OffloadedAdamW"),  # fp32 weights and gradients on the GPUs, moments on the host
    MemoryPlan("bf16", 4, 12, 2, "OffloadedAdamW(master_on_host=True)"),  # bf16 on the GPUs, master + moments host
)
# the activations of a 32K micro-batch of the 8B with full checkpointing beside the weights: 36 fp32 layer
# inputs (18 GiB), one layer's recomputation, the LM head's chunks (docs/gpu-results/paper_units.md)
ACTIVATION_RESERVE_BYTES = 40 * 2**30


def choose_memory_plan(params: float, gpus: int, gpu_memory_bytes: float, plans: Iterable[MemoryPlan] = MEMORY_PLANS,
                       activation_reserve_bytes: float = ACTIVATION_RESERVE_BYTES) -> MemoryPlan:
    """The first plan (fewest bytes moved to the host) whose share of a GPU fits beside the activations."""
    plans = list(plans)
    for plan in plans:
        if params * plan.gpu_bytes_per_param / gpus + activation_reserve_bytes <= gpu_memory_bytes:
            return plan
    raise ValueError(f"{params / 1e9:.1f} B parameters do not fit {gpus} GPU(s) of {gpu_memory_bytes / 2**30:.0f} GiB "
                     f"under any memory plan ({', '.join(plan.name for plan in plans)}): "
                     f"{plans[-1].gpu_bytes_per_param} bytes a parameter and "
                     f"{activation_reserve_bytes / 2**30:.0f} GiB of activations at least")


# ---------------------------------------------------------------- the trainer's setting: `optimizer_offload`
# Where the trainer keeps its weights, gradients and AdamW state: the `optimizer_offload` setting of RL and
# SFT (issue 63), read into one of `MEMORY_PLANS`.
#
# - ``off``: fp32 weights, gradients and ``torch.optim.AdamW``'s moments on the GPU (the default; what every
#   run did before the 8B: 16 bytes a parameter);
# - ``fp32``: fp32 weights and gradients on the GPU, the moments in page-locked host memory (``OffloadedAdamW``);
# - ``bf16``: the model loaded in bf16 (weights and gradients), the fp32 master and the moments on the host
#   (``OffloadedAdamW(master_on_host=True)``);
# - ``auto``: the first of those that fits beside the activations (``choose_memory_plan``) in the trainer's
#   share of a GPU (`trainer_gpu_bytes`); ``off`` without a GPU.
#
# The offloaded optimizers are built after ``accelerator.prepare(model)`` (they stream to the parameters'
# device, and FSDP2 replaces the parameters) and are not handed to accelerate: their state is saved beside
# accelerate's (`kpipe.train.checkpoint.save_training_state`).

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
                                betas: tuple[float, float], weight_decay: float,
                                init_dir: str | Path | None = None) -> tuple[Any, Any]:
    """The prepared model and its optimizer. AdamW goes through ``prepare`` with the model (FSDP2 rebuilds
    the parameters and the optimizer must hold the new ones); an OffloadedAdamW is built on the prepared
    model's parameters and stays outside accelerate (no fp16 loss scaling: bf16 or fp32 only). With the fp32
    master on the host, the master is read from the checkpoint `init_dir` the model was loaded from
    (``seed_host_master``)."""
    if plan.name == "gpu":
        return accelerator.prepare(model, build_optimizer(plan, model.parameters(), lr, betas, weight_decay))
    if accelerator.mixed_precision == "fp16":
        raise ValueError(f"optimizer_offload {plan.name!r} does not support fp16 mixed precision (no loss scaler "
                         "steps an OffloadedAdamW): use bf16")
    model = accelerator.prepare(model)
    optimizer = build_optimizer(plan, model.parameters(), lr, betas, weight_decay)
    if init_dir is not None and isinstance(optimizer, OffloadedAdamW) and optimizer.master_on_host:
        seed_host_master(optimizer, accelerator.unwrap_model(model), init_dir)
    return model, optimizer


def master_by_name(optimizer: OffloadedAdamW, model: Any) -> dict[str, torch.Tensor]:
    """The fp32 weight AdamW updates for each of `model`'s parameters (``OffloadedAdamW.master_weights``),
    by state-dict name; keep_vars gives the parameters themselves, so a tied head's name finds its
    embedding's."""
    by_id = {id(param): master for param, master in zip(optimizer.params, optimizer.master_weights())}
    return {name: by_id[id(param)] for name, param in model.state_dict(keep_vars=True).items() if id(param) in by_id}


def seed_host_master(optimizer: OffloadedAdamW, model: Any, model_dir: str | Path) -> int:
    """Copy a checkpoint's weights into the fp32 host master, by parameter name, and return how many. The
    ``bf16`` plan loads the model in bf16 and builds its master from that, which would drop what an fp32
    checkpoint holds below bf16's step: the updates of a previous stage at lr 1e-6."""
    from safetensors import safe_open

    masters = master_by_name(optimizer, model)
    seeded = 0
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                if name in masters:
                    masters[name].copy_(handle.get_tensor(name).reshape(masters[name].shape))
                    seeded += 1
    return seeded
