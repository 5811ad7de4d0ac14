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
