import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(
    x_ptr, out_ptr, n_features, n_inner, eps,
    stride_batch, stride_feature,
    BLOCK_SIZE: tl.constexpr,
):
    batch = tl.program_id(0).to(tl.int64)
    inner = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = inner < n_inner
    base = batch * stride_feature + inner

    sum_sq = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
    for f in range(0, n_features):
        x = tl.load(x_ptr + base + f * stride_feature, mask=mask, other=0.0).to(tl.float32)
        sum_sq += x * x
    inv_rms = 1.0 / tl.sqrt(sum_sq / n_features + eps)

    for f in range(0, n_features):
        x = tl.load(x_ptr + base + f * stride_feature, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + base + f * stride_feature, x * inv_rms, mask=mask)


class ModelNew(nn.Module):
    def __init__(self, num_features: int, eps: float = 1e-5):
        super().__init__()
        self.num_features = num_features
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        batch, features = x.shape[0], x.shape[1]
        n_inner = x[0, 0].numel()
        out = torch.empty_like(x)
        BLOCK_SIZE = min(4096, triton.next_power_of_2(n_inner))
        grid = (batch, triton.cdiv(n_inner, BLOCK_SIZE))
        rms_norm_kernel[grid](
            x, out, features, n_inner, self.eps, features * n_inner, n_inner,
            BLOCK_SIZE=BLOCK_SIZE, num_warps=8,
        )
        return out
