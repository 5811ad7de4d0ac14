import pytest

from kpipe.infra import gpu
from kpipe.infra.gpu import GPULeaseError, gpu_lease


@pytest.fixture
def four_gpus(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu, "visible_gpus", lambda: ["0", "1", "2", "3"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return tmp_path / "locks"


def test_lease_sets_visible_devices_and_restores(four_gpus):
    import os

    with gpu_lease(2, lock_dir=four_gpus) as held:
        assert held == ["0", "1"]
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"
        with gpu_lease(2, lock_dir=four_gpus) as other:
            assert other == ["2", "3"]
        with pytest.raises(GPULeaseError, match="only 2 of 3"):
            with gpu_lease(3, lock_dir=four_gpus, wait=False):
                pass
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_asking_for_more_than_exist_fails_fast(four_gpus):
    with pytest.raises(GPULeaseError, match="asks for 5 GPU"):
        with gpu_lease(5, lock_dir=four_gpus):
            pass


def test_zero_gpus_hides_all(four_gpus):
    import os

    with gpu_lease(0, lock_dir=four_gpus):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == ""


def test_cluster_preset_is_honoured(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert gpu.visible_gpus() == ["3", "5"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpu.visible_gpus() == []


def test_shares_fill_one_gpu_and_a_whole_gpu_waits_for_them(four_gpus, monkeypatch):
    from kpipe.infra.gpu import gpu_slot_lease

    monkeypatch.setattr(gpu, "visible_gpus", lambda: ["0", "1"])
    with gpu_slot_lease(1, 4, lock_dir=four_gpus) as first, gpu_slot_lease(2, 4, lock_dir=four_gpus) as second:
        assert first == second == ["0"]  # shares pack onto GPU 0, leaving GPU 1 whole
        with gpu_slot_lease(2, 4, lock_dir=four_gpus) as third:
            assert third == ["1"]  # GPU 0 has one slot left
        with gpu_slot_lease(4, 4, lock_dir=four_gpus) as whole:
            assert whole == ["1"]  # the GPU no share holds
            with pytest.raises(GPULeaseError, match="only 0 of 1"):
                with gpu_slot_lease(4, 4, lock_dir=four_gpus, wait=False):
                    pass
            with pytest.raises(GPULeaseError, match="no GPU has 2 free"):
                with gpu_slot_lease(2, 4, lock_dir=four_gpus, wait=False):
                    pass
    with gpu_slot_lease(8, 4, lock_dir=four_gpus) as both:
        assert both == ["0", "1"]  # every share released


def test_slots_neither_a_share_nor_whole_gpus_are_refused(four_gpus):
    from kpipe.infra.gpu import gpu_slot_lease

    with pytest.raises(GPULeaseError, match="neither a share"):
        with gpu_slot_lease(6, 4, lock_dir=four_gpus):
            pass


def test_a_jobs_log_names_the_cards_of_its_gpus(monkeypatch):
    """nvidia-smi's index -> name, by the ids a lease holds; "unknown" where nvidia-smi cannot say."""
    import subprocess

    listing = "0, NVIDIA H100 80GB HBM3\n1, NVIDIA H200\n"
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=listing))
    assert gpu.gpu_names(["1", "0", "7"]) == ["NVIDIA H200", "NVIDIA H100 80GB HBM3", "unknown"]

    def missing(*a, **k):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(subprocess, "run", missing)
    assert gpu.gpu_names(["0"]) == ["unknown"]
