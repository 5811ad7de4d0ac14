import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def partial_moments_kernel(x_ptr, partial_sum_ptr, partial_sq_ptr, row_size, n_chunks, BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offsets = chunk * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < row_size
    x = tl.load(x_ptr + row * row_size + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(partial_sum_ptr + row * n_chunks + chunk, tl.sum(x, axis=0))
    tl.store(partial_sq_ptr + row * n_chunks + chunk, tl.sum(x * x, axis=0))


@triton.jit
def layer_norm_apply_kernel(
    x_ptr, weight_ptr, bias_ptr, out_ptr, partial_sum_ptr, partial_sq_ptr,
    row_size, n_chunks, eps,
    BLOCK_SIZE: tl.constexpr, BLOCK_CHUNKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    chunk_ids = tl.arange(0, BLOCK_CHUNKS)
    chunk_mask = chunk_ids < n_chunks
    total = tl.sum(tl.load(partial_sum_ptr + row * n_chunks + chunk_ids, mask=chunk_mask, other=0.0), axis=0)
    total_sq = tl.sum(tl.load(partial_sq_ptr + row * n_chunks + chunk_ids, mask=chunk_mask, other=0.0), axis=0)
    mean = total / row_size
    var = tl.maximum(total_sq / row_size - mean * mean, 0.0)
    rstd = 1.0 / tl.sqrt(var + eps)

    offsets = chunk * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < row_size
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(weight_ptr + offsets, mask=mask, other=0.0)
    b = tl.load(bias_ptr + offsets, mask=mask, other=0.0)
    tl.store(out_ptr + row * row_size + offsets, (x - mean) * rstd * w + b, mask=mask)


class ModelNew(nn.Module):
    def __init__(self, normalized_shape: tuple):
        super().__init__()
        self.ln = nn.LayerNorm(normalized_shape=normalized_shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        row_size = self.ln.weight.numel()
        n_rows = x.numel() // row_size
        out = torch.empty_like(x)
        BLOCK_SIZE = min(4096, triton.next_power_of_2(row_size))
        n_chunks = triton.cdiv(row_size, BLOCK_SIZE)
        partial_sum = torch.empty((n_rows, n_chunks), device=x.device, dtype=torch.float32)
        partial_sq = torch.empty_like(partial_sum)
        grid = (n_rows, n_chunks)
        partial_moments_kernel[grid](x, partial_sum, partial_sq, row_size, n_chunks, BLOCK_SIZE=BLOCK_SIZE, num_warps=8)
        layer_norm_apply_kernel[grid](
            x, self.ln.weight, self.ln.bias, out, partial_sum, partial_sq, row_size, n_chunks, self.ln.eps,
            BLOCK_SIZE=BLOCK_SIZE, BLOCK_CHUNKS=triton.next_power_of_2(n_chunks), num_warps=8,
        )
        return out
