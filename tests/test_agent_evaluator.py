

def test_references_are_reused_unless_a_setting_says_otherwise():
    """Distillation and RL decide alike (so they share the run's KernelGym service): a setting
    wins, null reuses, on a GPU machine as on a CPU one."""
    from kpipe.agent.evaluator import reference_reuse

    assert reference_reuse(True) and not reference_reuse(False)
    assert reference_reuse(None)


class RecordingEvaluator:
    """Records each evaluate_many call's jobs; every job's result is its candidate."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    def evaluate_many(self, jobs):
        self.batches.append([candidate for _, candidate in jobs])
        return [candidate for _, candidate in jobs]


def test_a_burst_of_answers_goes_to_the_evaluator_in_one_call() -> None:
    """An engine hands a turn's answers over milliseconds apart: one call, not the first alone."""
    import time

    from kpipe.agent.evaluator import EvaluationStream

    evaluator = RecordingEvaluator()
    with EvaluationStream(evaluator, gather_idle_s=0.2, gather_max_s=5.0) as stream:
        for index in range(6):
            stream.put(index, ("ref", f"c{index}"))
            time.sleep(0.01)
        time.sleep(1.0)  # the burst is over: evaluated before the stream is closed
        assert evaluator.batches == [[f"c{index}" for index in range(6)]]
        stream.put(6, ("ref", "c6"))  # a later answer: a call of its own
        results = stream.results()
    assert evaluator.batches == [[f"c{index}" for index in range(6)], ["c6"]]
    assert results == {index: f"c{index}" for index in range(7)}


def test_answers_that_keep_coming_are_held_back_at_most_gather_max_s() -> None:
    import time

    from kpipe.agent.evaluator import EvaluationStream

    evaluator = RecordingEvaluator()
    stream = EvaluationStream(evaluator, gather_idle_s=0.3, gather_max_s=0.5)
    started = time.monotonic()
    for index in range(12):  # one every 0.1 s: never idle for 0.3 s
        stream.put(index, ("ref", f"c{index}"))
        time.sleep(0.1)
    first_call = len(evaluator.batches[0]) if evaluator.batches else None
    stream.results()
    assert first_call is not None and first_call < 12  # sent after 0.5 s, not after the last answer
    assert sum(len(batch) for batch in evaluator.batches) == 12
    assert time.monotonic() - started < 5.0


def test_closing_the_stream_sends_what_is_gathered_at_once() -> None:
    """The engine's generate() returned: the loop waits for the results, not for the gathering."""
    import time

    from kpipe.agent.evaluator import EvaluationStream

    evaluator = RecordingEvaluator()
    stream = EvaluationStream(evaluator, gather_idle_s=30.0, gather_max_s=60.0)
    stream.put(0, ("ref", "c0"))
    started = time.monotonic()
    assert stream.results() == {0: "c0"}
    assert time.monotonic() - started < 5.0
