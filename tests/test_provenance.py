import pytest

from kpipe.infra import provenance


def test_code_version_changes_only_with_the_named_code(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "gym").mkdir()
    (tmp_path / "data" / "a.py").write_text("x = 1")
    (tmp_path / "gym" / "b.py").write_text("y = 1")
    monkeypatch.setattr(provenance, "PACKAGE_ROOT", tmp_path)
    provenance.code_version.cache_clear()
    before = provenance.code_version("data")
    (tmp_path / "gym" / "b.py").write_text("y = 2")
    provenance.code_version.cache_clear()
    assert provenance.code_version("data") == before
    (tmp_path / "data" / "a.py").write_text("x = 2")
    provenance.code_version.cache_clear()
    assert provenance.code_version("data") != before
    provenance.code_version.cache_clear()


def test_unknown_part_is_an_error():
    with pytest.raises(FileNotFoundError, match="no kpipe part 'nope'"):
        provenance.code_version("nope")


def test_weights_identity_follows_content_not_times_and_reads_only_the_edges(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    weights = model / "model.safetensors"
    weights.write_bytes(bytes(3 * provenance.EDGE_BYTES))
    before = provenance.weights_identity(model)
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "model.safetensors").write_bytes(weights.read_bytes())
    assert provenance.weights_identity(copy) == before  # a copy, new times: the same model
    weights.write_bytes(bytes(3 * provenance.EDGE_BYTES - 1) + b"x")
    assert provenance.weights_identity(model) != before  # the last MiB changed
    weights.write_bytes(b"x" + bytes(3 * provenance.EDGE_BYTES - 1))
    assert provenance.weights_identity(model) != before  # the first MiB changed
    assert provenance.weights_identity(None) == "none"
    assert provenance.weights_identity(tmp_path / "org/hub-model") != provenance.weights_identity(tmp_path / "other")


def test_restart_keys_name_the_parts_that_changed():
    key = provenance.restart_key(settings={"lr": 1}, code="a", libraries=provenance.library_versions())
    assert provenance.key_changes(key, key) == ""
    changed = provenance.restart_key(settings={"lr": 2}, code="b", libraries=provenance.library_versions())
    assert provenance.key_changes(key, changed) == "code, settings changed"
    assert provenance.key_changes(None, key) == "it carries no restart key (written by an older kpipe)"
    assert set(provenance.library_versions()) == {"torch", "transformers", "triton", "accelerate", "vllm", "kpipe"}


def test_cached_evaluations_of_another_judge_are_not_replayed(tmp_path, monkeypatch):
    """A change of KernelGym's code, torch or Triton changes the result cache's key and the replay
    cache's, so a rerun evaluates again instead of returning the old judge's verdicts."""
    from kpipe.agent import evaluator
    from kpipe.gym import Protocol
    from kpipe.gym.judge import result

    calls = []

    class Counting:
        def evaluate_many(self, jobs):
            calls.extend(jobs)
            return [{"status": "pass"} for _ in jobs]

    path = tmp_path / "evals.jsonl"
    key = result.eval_key("ref", "cand", Protocol(), "cpu")
    for _ in range(2):
        evaluator.CachedEvaluator(Counting(), path, "protocol").evaluate_many([("ref", "cand")])
    assert len(calls) == 1  # replayed
    for module in (result, evaluator):
        monkeypatch.setattr(module, "judge_version", lambda: "another judge")
    assert result.eval_key("ref", "cand", Protocol(), "cpu") != key
    evaluator.CachedEvaluator(Counting(), path, "protocol").evaluate_many([("ref", "cand")])
    assert len(calls) == 2


def test_source_digest_ignores_comments_docstrings_and_formatting_not_constants(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('"""Module."""\nLIMIT = 3\n\n\ndef f(x):\n    """Why."""\n    return x + LIMIT\n')
    before = provenance.source_digest(module)
    module.write_text('"""Module, reworded."""\n# a comment\nLIMIT = 3  # why three\n\ndef f( x ):\n'
                      '    """Why, reworded."""\n    return (x + LIMIT)\n')
    assert provenance.source_digest(module) == before
    module.write_text('"""Module."""\nLIMIT = 4\n\n\ndef f(x):\n    """Why."""\n    return x + LIMIT\n')
    assert provenance.source_digest(module) != before
    module.write_text('"""Module."""\nLIMIT = 3\n\n\ndef f(x):\n    return x + LIMIT\n    """no longer a docstring"""\n')
    assert provenance.source_digest(module) != before
    data = tmp_path / "bank.json"
    data.write_text('{"a": 1}')
    before = provenance.source_digest(data)
    data.write_text('{"a":  1}')
    assert provenance.source_digest(data) != before  # package data counts by its bytes
