"""scripts/wheelhouse.py: what a machine without internet is given (make wheelhouse)."""

from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

SPEC = importlib.util.spec_from_file_location("wheelhouse", Path(__file__).parent.parent / "scripts" / "wheelhouse.py")
assert SPEC is not None and SPEC.loader is not None
wheelhouse = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(wheelhouse)


def test_the_targets_listing_is_read_with_and_without_versions(tmp_path: Path) -> None:
    listing = tmp_path / "freeze.txt"
    listing.write_text("# pip list\nTorch==2.11.0\npackaging==26.3\nnvidia_cublas\n")
    have = wheelhouse.installed(listing)
    assert have == {"torch": "2.11.0", "packaging": "26.3", "nvidia-cublas": None}
    assert wheelhouse.satisfied(Requirement("torch>=2.4"), have)
    assert not wheelhouse.satisfied(Requirement("packaging<26,>=24.0"), have)  # too new for snakemake: fetched
    assert wheelhouse.satisfied(Requirement("nvidia-cublas>=99"), have)  # a bare name satisfies anything
    assert not wheelhouse.satisfied(Requirement("duckdb>=2.0"), have)


def test_only_the_requirements_that_apply_on_the_target_are_followed(tmp_path: Path) -> None:
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("demo-1.0.dist-info/METADATA", "\n".join([
            "Name: demo", "Version: 1.0",
            "Requires-Dist: always>=1",
            "Requires-Dist: windows-only; sys_platform == 'win32'",
            "Requires-Dist: old-python; python_version < '3.8'",
            "Requires-Dist: with-extra; extra == 'fast'",
        ]))
    environment = wheelhouse.target_environment("3.12")
    assert [r.name for r in wheelhouse.requirements_of(wheel, set(), environment)] == ["always"]
    assert [r.name for r in wheelhouse.requirements_of(wheel, {"fast"}, environment)] == ["always", "with-extra"]


def test_parts_stay_under_the_limit_unless_one_wheel_is_larger(tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    staging.mkdir()
    sizes = {"a": 40, "b": 30, "c": 25, "d": 5, "huge": 90}
    for name, kib in sizes.items():
        (staging / f"{name}-1-py3-none-any.whl").write_bytes(b"x" * kib * 1024)
    parts = wheelhouse.split_parts(sorted(staging.glob("*.whl")), tmp_path / "out", 60 * 1024)
    folders = sorted((tmp_path / "out").glob("part-*"))
    assert len(folders) == len(parts) == 3
    totals = sorted(sum(f.stat().st_size for f in folder.iterdir()) // 1024 for folder in folders)
    assert totals == [45, 55, 90]  # largest first, each into the first part it fits: huge | a+d | b+c
    assert not list(staging.glob("*.whl"))
