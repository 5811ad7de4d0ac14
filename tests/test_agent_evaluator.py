

def test_references_are_reused_unless_a_setting_says_otherwise():
    """Distillation and RL decide alike (so they share the run's KernelGym service): a setting
    wins, null reuses, on a GPU machine as on a CPU one."""
    from kpipe.agent.evaluator import reference_reuse

    assert reference_reuse(True) and not reference_reuse(False)
    assert reference_reuse(None)
