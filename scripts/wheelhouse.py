#!/usr/bin/env python
"""A wheelhouse for a machine without internet: the wheels kpipe needs beyond what the target
already has, for the target's Python and platform, in parts of at most 60 MiB.

    python scripts/wheelhouse.py --have target-freeze.txt --python 3.12 --out wheelhouse
    python scripts/wheelhouse.py --have target-freeze.txt --also vllm==0.26.0 --out wheelhouse   # with vLLM
    # on the target, part by part (or all at once):
    python -m pip install --no-index --find-links wheelhouse/part-1 ... -e . (see README)
    # vLLM alone, less what it never imports on our paths (docs/vllm-on-the-device.md):
    python scripts/wheelhouse.py --have docs/device-freeze.txt --also vllm==0.26.0 --without-kpipe \
        --skip flashinfer-python ... --pin xgrammar==0.2.7 --part-mib 58 --out wheelhouse-vllm

``--have`` is ``python -m pip list --format=freeze`` (or a list of names) from the target: every
package there whose version satisfies what is asked is left out, and not followed (a listing of
names only counts as satisfying everything). From kpipe's dependencies in ``pyproject.toml``, each
missing one is fetched for the target's Python and platform with ``pip download --no-deps``
(binary wheels only, newest that satisfies its specifier), and its ``Requires-Dist`` that apply
on the target are followed, breadth first. Parts are folders ``part-1``, ``part-2``, ... filled
in install order of size, none over ``--part-mib``. ``--skip NAME`` leaves a package out and
does not follow it (one shown unneeded where the target runs); ``--pin NAME==VER`` (any
specifier) narrows every requirement on NAME, as pip's constraints do, to settle a conflict
between pins of different packages. ``--drop NAME:PATTERN`` rewrites NAME's wheel without the
members matching PATTERN (and their RECORD lines). A wheel larger than a part is cut into
``<wheel>.chunk-00``, ``-01``, ... that fill parts like wheels; ``SHA256SUMS`` in every part lists
every whole wheel. On the target, with every part's files in one folder::

    for c in *.chunk-00; do [ -e "$c" ] || continue; w=${c%.chunk-00}; cat "$w".chunk-* > "$w" && rm "$w".chunk-*; done; sha256sum -c --ignore-missing SHA256SUMS

Why a script and not ``pip download`` alone: pip cannot leave out what another machine already
has, and the GPU device this project is checked on takes at most 64 MiB per call.
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import hashlib
import io
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parent.parent
PLATFORMS = ("manylinux_2_39_x86_64", "manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "linux_x86_64")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed(freeze: Path) -> dict[str, str | None]:
    """Package name -> version (None where the listing gives names only) of a
    ``pip list --format=freeze`` listing."""
    found: dict[str, str | None] = {}
    for line in freeze.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            found[canonical(re.split(r"[<>@ ;\[]", name, maxsplit=1)[0])] = version.strip() or None
    return found


def satisfied(requirement: Requirement, have: dict[str, str | None]) -> bool:
    """Whether the target's installed version (if any) meets `requirement`; a name without a
    version counts as meeting it."""
    name = canonical(requirement.name)
    if name not in have:
        return False
    version = have[name]
    return version is None or requirement.specifier.contains(version, prereleases=True)


def pip_platform_args(python: str) -> list[str]:
    args = ["--only-binary=:all:", "--python-version", python, "--implementation", "cp"]
    for platform in PLATFORMS:
        args += ["--platform", platform]
    return args


def target_environment(python: str) -> dict[str, str]:
    """Marker values of the target (Linux x86-64, CPython `python`)."""
    return {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux", "os_name": "posix",
            "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
            "platform_python_implementation": "CPython", "extra": ""}


class NoRelease(Exception):
    """No release of a package meets the specifier asked for."""


def fetch(requirement: Requirement, python: str, dest: Path) -> Path:
    """The newest binary wheel satisfying `requirement` for the target, without its dependencies;
    a source-only package is built here, which must give a pure-Python wheel."""
    before = set(dest.glob("*.whl"))
    spec = str(Requirement(f"{requirement.name}{requirement.specifier}"))
    binary = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest),
                             *pip_platform_args(python), spec], capture_output=True, text=True)
    if binary.returncode != 0:  # published as a source distribution only: build it here (pure Python ones)
        built_here = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(dest), spec])
        if built_here.returncode != 0:
            raise NoRelease(f"{spec}: no release as a wheel for the target or as a source")
        built = [w for w in set(dest.glob("*.whl")) - before]
        if not built or not built[0].name.endswith("-none-any.whl"):
            raise SystemExit(f"{spec}: no binary wheel for the target, and its source does not build a pure-Python one")
    name = canonical(requirement.name)
    new = [w for w in set(dest.glob("*.whl")) - before] or [w for w in dest.glob("*.whl") if canonical(w.name.split("-")[0]) == name]
    return new[0]


def requirements_of(wheel: Path, extras: set[str], environment: dict[str, str]) -> list[Requirement]:
    """The wheel's Requires-Dist that apply on the target with `extras`."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(metadata).decode().splitlines()
    found = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            requirement = Requirement(line.split(":", 1)[1].strip())
            if requirement.marker is None or any(requirement.marker.evaluate({**environment, "extra": e}) for e in extras | {""}):
                found.append(requirement)
    return found


def wheel_version(wheel: Path) -> str:
    return wheel.name.split("-")[1]


def with_extras(requirement: Requirement, extras: set[str], specifier: object) -> Requirement:
    listed = f"[{','.join(sorted(extras))}]" if extras else ""
    return Requirement(f"{requirement.name}{listed}{specifier}")


def pinned(requirement: Requirement, pins: dict[str, SpecifierSet]) -> Requirement:
    """`requirement` narrowed by the pin on its name, if any."""
    pin = pins.get(canonical(requirement.name))
    return requirement if pin is None else with_extras(requirement, set(requirement.extras), requirement.specifier & pin)


def collect(roots: list[Requirement], python: str, have: dict[str, str | None], dest: Path,
            skip: frozenset[str] = frozenset(), pins: dict[str, SpecifierSet] | None = None) -> list[Path]:
    """Every wheel the target lacks, breadth first from `roots`: a package the target has in a
    version that satisfies the (pinned) requirement is not followed (its own dependencies are there
    with it), nor is one in `skip`. A package asked for again is fetched again under both
    specifiers when its wheel does not meet the new one (vLLM pins many of kpipe's loose ones),
    and new extras add their dependencies."""
    environment = target_environment(python)
    dest.mkdir(parents=True, exist_ok=True)
    seen: dict[str, tuple[Path, Requirement]] = {}
    skipped: set[str] = set()
    queue = list(roots)
    while queue:
        requirement = pinned(queue.pop(0), pins or {})
        name = canonical(requirement.name)
        if name in skip:
            if name not in skipped:
                print(f"  skipped {requirement}", flush=True)
                skipped.add(name)
            continue
        if satisfied(requirement, have):
            continue
        if name in seen:
            wheel, before = seen[name]
            extras = set(requirement.extras) | set(before.extras)
            if requirement.specifier.contains(wheel_version(wheel), prereleases=True):
                if extras != set(before.extras):
                    seen[name] = (wheel, with_extras(before, extras, before.specifier))
                    queue += requirements_of(wheel, extras, environment)
                continue
            wheel.unlink()
            both = with_extras(requirement, extras, before.specifier & requirement.specifier)
            try:
                wheel = fetch(both, python, dest)
                requirement = both
            except NoRelease:  # none meets both: this requirer's wins here, `resolve` settles the other
                requirement = with_extras(requirement, extras, requirement.specifier)
                wheel = fetch(requirement, python, dest)
        else:
            wheel = fetch(requirement, python, dest)
        seen[name] = (wheel, requirement)
        print(f"  {wheel.name}", flush=True)
        queue += requirements_of(wheel, set(requirement.extras), environment)
    return sorted(wheel for wheel, _ in seen.values())


def unmet(wheels: list[Path], python: str, skip: frozenset[str] = frozenset()) -> list[tuple[Path, Requirement, str]]:
    """Base requirements of the chosen wheels that the chosen version of the package they name does
    not meet (requiring wheel, requirement, chosen version): breadth-first fetching picks each
    package's newest release for the first specifier it meets, so a later requirer can be left
    unmet (snakemake-interface-common 1.24.1 wants packaging>=26.1, snakemake 9.27 packaging<26)."""
    environment = target_environment(python)
    chosen = {canonical(wheel.name.split("-")[0]): wheel_version(wheel) for wheel in wheels}
    found = []
    for wheel in wheels:
        for requirement in requirements_of(wheel, set(), environment):
            name = canonical(requirement.name)
            if name in chosen and name not in skip and not requirement.specifier.contains(chosen[name], prereleases=True):
                found.append((wheel, requirement, chosen[name]))
    return found


def resolve(roots: list[Requirement], python: str, have: dict[str, str | None], dest: Path,
            skip: frozenset[str] = frozenset(), pins: dict[str, SpecifierSet] | None = None,
            rounds: int = 10) -> list[Path]:
    """`collect` until no chosen wheel's requirement is left unmet: each round, a package whose
    requirement is unmet is held below its chosen release (as pip's resolver backtracks), and the
    collection starts again. Stops with the conflicts when `rounds` do not settle them."""
    pins = dict(pins or {})
    for _ in range(rounds):
        wheels = collect(roots, python, have, dest, skip, pins)
        conflicts = unmet(wheels, python, skip)
        if not conflicts:
            return wheels
        for wheel, requirement, version in conflicts:
            name = canonical(wheel.name.split("-")[0])
            print(f"  {wheel.name}: needs {requirement}, the set has {version}: trying {name}<{wheel_version(wheel)}",
                  flush=True)
            pins[name] = pins.get(name, SpecifierSet()) & SpecifierSet(f"<{wheel_version(wheel)}")
        shutil.rmtree(dest)
    raise SystemExit("no consistent set: " + "; ".join(f"{w.name} needs {r} (have {v})" for w, r, v in conflicts))


def drop_members(wheel: Path, patterns: list[str]) -> int:
    """Rewrite `wheel` without its members that match `patterns` (fnmatch) and their RECORD lines:
    files the target never loads (vLLM's FlashAttention-2 build on a Hopper GPU) that would cost a
    whole upload. Returns the bytes saved; a pattern that matches nothing stops the run."""
    slim = wheel.with_name(wheel.name + ".slim")
    with zipfile.ZipFile(wheel) as source:
        names = source.namelist()
        matches = {p: {n for n in names if fnmatch.fnmatchcase(n, p)} for p in patterns}
        if unmatched := [p for p, found in matches.items() if not found]:
            raise SystemExit(f"{wheel.name}: nothing matches {', '.join(unmatched)}")
        dropped = set().union(*matches.values())
        with zipfile.ZipFile(slim, "w") as target:
            for info in source.infolist():
                if info.filename in dropped:
                    continue
                data = source.read(info)
                if info.filename.endswith(".dist-info/RECORD"):
                    rows = [row for row in csv.reader(io.StringIO(data.decode())) if row and row[0] not in dropped]
                    text = io.StringIO()
                    csv.writer(text, lineterminator="\n").writerows(rows)
                    data = text.getvalue().encode()
                target.writestr(info, data)
    saved = wheel.stat().st_size - slim.stat().st_size
    slim.replace(wheel)
    return saved


def chunk(wheel: Path, chunk_bytes: int) -> list[Path]:
    """`wheel` cut into ``<wheel>.chunk-NN`` files of at most `chunk_bytes` beside it (the wheel
    itself removed), so that each fits a part; ``cat`` in name order joins them again."""
    size = wheel.stat().st_size
    count = -(-size // chunk_bytes)
    width = max(2, len(str(count - 1)))
    chunks = []
    with wheel.open("rb") as source:
        for index in range(count):
            piece = wheel.with_name(f"{wheel.name}.chunk-{index:0{width}d}")
            piece.write_bytes(source.read(chunk_bytes))
            chunks.append(piece)
    wheel.unlink()
    return chunks


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as source:
        for block in iter(lambda: source.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def chunk_large(wheels: list[Path], part_bytes: int) -> tuple[list[Path], str]:
    """The files to pack (each wheel over `part_bytes` replaced by its chunks) and the
    ``sha256sum`` listing of every whole wheel, taken before any is cut."""
    listing = "".join(f"{sha256(wheel)}  {wheel.name}\n" for wheel in sorted(wheels))
    files = []
    for wheel in wheels:
        files += chunk(wheel, part_bytes) if wheel.stat().st_size > part_bytes else [wheel]
    return files, listing


def project_requirements(extras: str) -> list[Requirement]:
    """kpipe's build and run dependencies (and those of `extras`), from pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]  # kpipe builds on the target
    names = [*build, *project["dependencies"]]
    for extra in filter(None, extras.split(",")):
        names += project["optional-dependencies"][extra]
    return [Requirement(n) for n in names]


def split_parts(wheels: list[Path], out: Path, part_bytes: int) -> list[list[Path]]:
    """First-fit decreasing into folders of at most `part_bytes` (a larger wheel alone)."""
    parts: list[list[Path]] = []
    sizes: list[int] = []
    for wheel in sorted(wheels, key=lambda w: -w.stat().st_size):
        size = wheel.stat().st_size
        for index, used in enumerate(sizes):
            if used + size <= part_bytes:
                parts[index].append(wheel)
                sizes[index] += size
                break
        else:
            parts.append([wheel])
            sizes.append(size)
    for index, members in enumerate(parts, start=1):
        folder = out / f"part-{index}"
        folder.mkdir(parents=True, exist_ok=True)
        for wheel in members:
            shutil.move(str(wheel), folder / wheel.name)
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--have", type=Path, required=True, help="the target's `python -m pip list --format=freeze`")
    parser.add_argument("--python", default="3.12", help="the target's Python version (default 3.12)")
    parser.add_argument("--out", type=Path, default=ROOT / "wheelhouse")
    parser.add_argument("--part-mib", type=float, default=60.0)
    parser.add_argument("--extras", default="", help="extras of kpipe to include, e.g. dev")
    parser.add_argument("--also", action="append", default=[], type=Requirement, metavar="REQ",
                        help="a further requirement, e.g. vllm==0.26.0 (the release that fits the target's torch, "
                             "where the extra's range would resolve to a newer one); repeatable")
    parser.add_argument("--without-kpipe", action="store_true", help="the --also requirements alone, not kpipe's")
    parser.add_argument("--skip", action="append", default=[], metavar="NAME",
                        help="a package to leave out, with what only it needs (shown unneeded on the target); repeatable")
    parser.add_argument("--pin", action="append", default=[], type=Requirement, metavar="NAME==VER",
                        help="narrow every requirement on NAME (a constraint, as pip's -c); repeatable")
    parser.add_argument("--drop", action="append", default=[], metavar="NAME:PATTERN",
                        help="leave the members matching PATTERN (fnmatch) out of NAME's wheel, e.g. "
                             "vllm:vllm/vllm-rs (a file shown unused on the target); repeatable")
    args = parser.parse_args()
    have = installed(args.have)
    if args.out.exists():
        shutil.rmtree(args.out)
    staging = args.out / "staging"
    roots = [*args.also, *([] if args.without_kpipe else project_requirements(args.extras))]
    pins = {canonical(pin.name): pin.specifier for pin in args.pin}
    wheels = resolve(roots, args.python, have, staging, frozenset(map(canonical, args.skip)), pins)
    drops: dict[str, list[str]] = {}
    for spec in args.drop:
        name, _, pattern = spec.partition(":")
        drops.setdefault(canonical(name), []).append(pattern)
    for wheel in wheels:
        if patterns := drops.get(canonical(wheel.name.split("-")[0])):
            print(f"  {wheel.name}: {drop_members(wheel, patterns) / 2**20:.1f} MiB dropped", flush=True)
    limit = int(args.part_mib * 2**20)
    files, listing = chunk_large(wheels, limit)
    parts = split_parts(files, args.out, limit)
    staging.rmdir()
    for index, members in enumerate(parts, start=1):
        folder = args.out / f"part-{index}"
        (folder / "SHA256SUMS").write_text(listing)
        size = sum((folder / f.name).stat().st_size for f in members)
        print(f"part-{index}: {len(members)} files, {size / 2**20:.1f} MiB")
    total = sum(f.stat().st_size for f in args.out.glob("part-*/*") if f.name != "SHA256SUMS")
    print(f"{len(wheels)} wheels the target lacks, {total / 2**20:.1f} MiB -> {args.out}")


if __name__ == "__main__":
    main()
