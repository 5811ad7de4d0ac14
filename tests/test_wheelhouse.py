"""scripts/wheelhouse.py: what a machine without internet is given (make wheelhouse)."""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
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


def test_a_pin_narrows_every_requirement_on_its_name() -> None:
    pins = {"xgrammar": Requirement("xgrammar==0.2.7").specifier}
    narrowed = wheelhouse.pinned(Requirement("xgrammar[test]<1.0.0,>=0.2.1"), pins)
    assert narrowed.name == "xgrammar" and narrowed.extras == {"test"}
    assert narrowed.specifier.contains("0.2.7") and not narrowed.specifier.contains("0.2.8")
    assert wheelhouse.pinned(Requirement("openai>=2"), pins) == Requirement("openai>=2")
    # the target's version must meet the pin too, else the pinned release is fetched
    assert not wheelhouse.satisfied(narrowed, {"xgrammar": "0.2.8"})


def test_skipped_and_satisfied_packages_are_neither_fetched_nor_followed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def demo_wheel(name: str, requires: list[str]) -> Path:
        wheel = tmp_path / "index" / f"{name}-1.0-py3-none-any.whl"
        wheel.parent.mkdir(exist_ok=True)
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(f"{name}-1.0.dist-info/METADATA",
                             "\n".join([f"Name: {name}", "Version: 1.0", *(f"Requires-Dist: {r}" for r in requires)]))
        return wheel

    index = {"app": demo_wheel("app", ["big-kernels", "small", "torch==2.11.0"]),
             "big-kernels": demo_wheel("big_kernels", ["huge-runtime"]), "small": demo_wheel("small", [])}
    fetched = []

    def fake_fetch(requirement: Requirement, python: str, dest: Path) -> Path:
        fetched.append(wheelhouse.canonical(requirement.name))
        return Path(shutil.copy(index[wheelhouse.canonical(requirement.name)], dest))

    monkeypatch.setattr(wheelhouse, "fetch", fake_fetch)
    wheels = wheelhouse.collect([Requirement("app==1.0")], "3.12", {"torch": "2.11.0"}, tmp_path / "out",
                                skip=frozenset({"big-kernels"}))
    assert fetched == ["app", "small"]  # huge-runtime, asked for by the skipped package only, is not reached
    assert [w.name for w in wheels] == ["app-1.0-py3-none-any.whl", "small-1.0-py3-none-any.whl"]


def test_a_wheel_over_the_part_size_travels_in_chunks_that_cat_joins(tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    staging.mkdir()
    big = staging / "big-1-py3-none-any.whl"
    content = bytes(range(256)) * 1000  # 256,000 bytes
    big.write_bytes(content)
    small = staging / "small-1-py3-none-any.whl"
    small.write_bytes(b"s" * 30_000)
    files, listing = wheelhouse.chunk_large([big, small], 100_000)
    assert sorted(f.name for f in files) == ["big-1-py3-none-any.whl.chunk-00", "big-1-py3-none-any.whl.chunk-01",
                                             "big-1-py3-none-any.whl.chunk-02", "small-1-py3-none-any.whl"]
    assert not big.exists()
    assert listing == (f"{hashlib.sha256(content).hexdigest()}  big-1-py3-none-any.whl\n"
                       f"{hashlib.sha256(b's' * 30_000).hexdigest()}  small-1-py3-none-any.whl\n")
    parts = wheelhouse.split_parts(files, tmp_path / "out", 100_000)
    assert len(parts) == 3  # two full chunks alone, the 56,000-byte tail with the small wheel
    assert all(sum(f.stat().st_size for f in (tmp_path / "out").glob(f"part-{i}/*")) <= 100_000 for i in (1, 2, 3))
    # on the target: every part's files in one folder, then the documented one-liner
    joined = tmp_path / "target"
    joined.mkdir()
    for piece in (tmp_path / "out").glob("part-*/*"):
        shutil.copy(piece, joined)
    (joined / "SHA256SUMS").write_text(listing)
    one_liner = wheelhouse.__doc__.split("::\n\n", 1)[1].strip().splitlines()[0].strip()
    subprocess.run(["bash", "-c", one_liner], cwd=joined, check=True, capture_output=True)
    assert (joined / "big-1-py3-none-any.whl").read_bytes() == content
    assert not list(joined.glob("*.chunk-*"))


def test_dropped_members_leave_the_wheel_and_its_record(tmp_path: Path) -> None:
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    record = ("demo/__init__.py,sha256=a,1\ndemo/_fa2_C.so,sha256=b,9\n\"demo/odd,name.txt\",sha256=c,2\n"
              "demo-1.0.dist-info/RECORD,,\n")
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("demo/__init__.py", "x")
        archive.writestr("demo/_fa2_C.so", b"\0" * 50_000)
        archive.writestr("demo/odd,name.txt", "kept")
        archive.writestr("demo-1.0.dist-info/RECORD", record)
    assert wheelhouse.drop_members(wheel, ["demo/_fa2_*"]) > 0
    with zipfile.ZipFile(wheel) as archive:
        assert archive.namelist() == ["demo/__init__.py", "demo/odd,name.txt", "demo-1.0.dist-info/RECORD"]
        assert archive.read("demo-1.0.dist-info/RECORD").decode() == (
            "demo/__init__.py,sha256=a,1\n\"demo/odd,name.txt\",sha256=c,2\ndemo-1.0.dist-info/RECORD,,\n")
    with pytest.raises(SystemExit, match="nothing matches demo/typo"):
        wheelhouse.drop_members(wheel, ["demo/typo"])


def test_a_requirer_left_unmet_is_held_below_its_release_until_the_set_agrees(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """snakemake 9.27 wants packaging<26 and snakemake-interface-common 1.24.1 packaging>=26.1: fetched
    breadth first, the set held packaging 25.0 beside interface-common 1.24.1 and failed `pip check` on
    the GPU device. The unmet requirer goes back one release (1.23.0), whose requirement the set meets."""
    from packaging.version import Version

    def demo_wheel(name: str, version: str, requires: list[str]) -> Path:
        wheel = tmp_path / "index" / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
        wheel.parent.mkdir(exist_ok=True)
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(f"{name}-{version}.dist-info/METADATA", "\n".join(
                [f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)]))
        return wheel

    index = [demo_wheel("interface-common", "1.24.1", ["packaging>=26.1"]),
             demo_wheel("interface-common", "1.23.0", ["packaging>=24"]),
             demo_wheel("snakemake", "9.27.1", ["packaging<26,>=24", "interface-common>=1.20"]),
             demo_wheel("packaging", "26.4", []), demo_wheel("packaging", "25.0", [])]

    def fake_fetch(requirement: Requirement, python: str, dest: Path) -> Path:
        name = wheelhouse.canonical(requirement.name)
        matches = [w for w in index if wheelhouse.canonical(w.name.split("-")[0]) == name
                   and requirement.specifier.contains(wheelhouse.wheel_version(w))]
        if not matches:
            raise wheelhouse.NoRelease(str(requirement))
        newest = max(matches, key=lambda w: Version(wheelhouse.wheel_version(w)))
        return Path(shutil.copy(newest, dest))

    monkeypatch.setattr(wheelhouse, "fetch", fake_fetch)
    roots = [Requirement("interface-common"), Requirement("snakemake")]
    assert wheelhouse.unmet(wheelhouse.collect(roots, "3.12", {}, tmp_path / "once"), "3.12")  # the old way
    wheels = wheelhouse.resolve(roots, "3.12", {}, tmp_path / "out")
    assert sorted(w.name for w in wheels) == ["interface_common-1.23.0-py3-none-any.whl",
                                              "packaging-25.0-py3-none-any.whl", "snakemake-9.27.1-py3-none-any.whl"]
