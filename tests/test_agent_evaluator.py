

def test_references_are_reused_by_default_only_without_gpus(monkeypatch):
    """Distillation and RL decide alike (so on a GPU they share the run's KernelGym service): a
    setting wins; null reuses on a CPU machine and times every candidate next to its reference on a GPU."""
    from kpipe.agent.evaluator import reference_reuse

    assert reference_reuse(True) and not reference_reuse(False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert reference_reuse(None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert not reference_reuse(None)
