"""PR (Dr. Kernel Eq. 7): T_generated / T_total, T_total "the overall CUDA execution time"."""

from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from kpipe.gym.candidate.profiling import cuda_time_per_name, profile_summary


def event(name: str, us: float, device: DeviceType = DeviceType.CUDA) -> SimpleNamespace:
    return SimpleNamespace(name=name, trace_name=name, device_type=device,
                           time_range=SimpleNamespace(elapsed_us=lambda: us))


def test_pr_divides_by_total_cuda_time_memcpy_and_memset_included():
    events = [event("my_fused_kernel", 300.0), event("ampere_sgemm_128x64", 500.0),
              event("Memcpy HtoD (Pageable -> Device)", 150.0), event("Memset (Device)", 50.0),
              event("aten::addmm", 900.0, DeviceType.CPU)]  # host events are not CUDA time
    per_name = cuda_time_per_name(events, runs=2)
    assert per_name["Memcpy HtoD (Pageable -> Device)"] == pytest.approx(0.075)
    assert "aten::addmm" not in per_name
    summary = profile_summary(per_name, {"my_fused_kernel"}, "cuda")
    t_generated, t_total = 300.0, 300.0 + 500.0 + 150.0 + 50.0
    assert summary["pr"] == pytest.approx(t_generated / t_total)  # Eq. 7; the old ratio left copies out: 300/800
