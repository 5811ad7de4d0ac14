#!/usr/bin/env python
"""Ray for the GPU device: a stripped wheel (and Ray core's dependencies) that fit its upload cap.

    python scripts/device_ray_wheel.py                 # cp312 wheels into .whl/ (what the device runs)
    python scripts/device_ray_wheel.py --python 3.11 --dest /tmp/raytest   # same stripping, for a local try

The device has no network and takes at most 64 MiB of uploaded tree; Ray's manylinux wheel is
79 MB. What a single-node cluster with actors needs is Ray core: ``_raylet.so``, the GCS and
raylet binaries, the Python package and the agents the raylet starts (the runtime-env agent
with its vendored aiohttp, the dashboard agent in minimal mode, the autoscaler monitor). This
script downloads the wheel of ``--ray-version`` for ``--python`` from the package index, and
writes it back under the same file name (so ``scripts/device_env.sh`` installs it) without:

- ``ray/jars/``: the Java worker (31 MB compressed);
- ``ray/dashboard/client/``: the dashboard's web UI build (its JS, source maps);
- the libraries on top of core, not imported by it: ``rllib``, ``tune``, ``train``, ``serve``,
  ``data``, ``llm``, ``air`` (only their own dashboard modules import them, and those are not
  loaded without the dashboard);
- debug symbols: every ELF file goes through ``strip --strip-unneeded``.

``RECORD`` is rewritten with the new hashes; entries keep their order and timestamps, so the
same inputs give the same wheel. Beside it go the wheels of Ray core's runtime dependencies
that the device image (torch, triton, transformers, accelerate, pyarrow, numpy and their
dependencies) lacks, at the versions of the dev environment: msgpack, protobuf, jsonschema and
its dependencies (click and requests are already carried). Older ``ray-*`` wheels in the
destination are removed.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RAY_VERSION = "2.60.0"  # pyproject asks for ray>=2.60; the dev environment runs 2.60.0
# Ray core's Requires-Dist (click, filelock, jsonschema, msgpack, packaging, protobuf, pyyaml,
# requests) less what the device already has: filelock/packaging/pyyaml come with torch and
# transformers; click and requests are carried in .whl/ already.
DEPENDENCIES = ("msgpack==1.2.4", "protobuf==7.36.2", "jsonschema==4.26.0", "jsonschema-specifications==2025.9.1",
                "referencing==0.37.0", "rpds-py==2026.9.1", "attrs==26.1.0")
DROPPED = ("ray/jars/", "ray/dashboard/client/", "ray/rllib/", "ray/tune/", "ray/train/", "ray/serve/", "ray/data/",
           "ray/llm/", "ray/air/")
MIB = 1024 * 1024


def download(requirements: list[str], python: str, into: Path) -> list[Path]:
    into.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", python, "--implementation", "cp", "--platform", "manylinux2014_x86_64",
                    "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux_2_28_x86_64",
                    "-d", str(into), *requirements], check=True)
    found = []
    for requirement in requirements:
        name, version = requirement.split("==")
        stem = re.sub(r"[-_.]+", "_", name).lower()
        matches = [p for p in into.glob("*.whl")
                   if re.sub(r"[-_.]+", "_", p.name.split("-")[0]).lower() == stem and p.name.split("-")[1] == version]
        if not matches:
            raise SystemExit(f"no wheel for {requirement} in {into}")
        found.append(max(matches, key=lambda p: ("cp" + python.replace(".", "")) in p.name))
    return found


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def strip_elf(data: bytes, work: Path) -> bytes:
    if not data.startswith(b"\x7fELF"):
        return data
    path = work / "elf"
    path.write_bytes(data)
    subprocess.run(["strip", "--strip-unneeded", str(path)], check=True)
    return path.read_bytes()


def strip_wheel(source: Path, dest: Path) -> dict[str, int]:
    """Write `source` to `dest` without the DROPPED trees and with stripped ELF files."""
    kept = dropped = stripped = 0
    record_name = next(n for n in zipfile.ZipFile(source).namelist() if n.endswith(".dist-info/RECORD"))
    records = []
    with zipfile.ZipFile(source) as zin, zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout, \
            tempfile.TemporaryDirectory() as tmp:
        for info in zin.infolist():
            name = info.filename
            if name == record_name:
                continue
            if name.startswith(DROPPED) or name.endswith(".js.map"):
                dropped += 1
                continue
            data = zin.read(info)
            new = strip_elf(data, Path(tmp))
            stripped += new is not data and new != data
            out = zipfile.ZipInfo(name, date_time=info.date_time)
            out.external_attr = info.external_attr
            out.compress_type = zipfile.ZIP_DEFLATED
            zout.writestr(out, new, compresslevel=9)
            records.append(f"{name},{record_hash(new)},{len(new)}")
            kept += 1
        records.append(f"{record_name},,")
        out = zipfile.ZipInfo(record_name, date_time=zin.getinfo(record_name).date_time)
        out.external_attr = zin.getinfo(record_name).external_attr
        zout.writestr(out, "\n".join(records) + "\n", compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    return {"kept": kept, "dropped": dropped, "stripped": stripped}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", default="3.12", help="the device's Python (3.12); 3.11 for a local try")
    parser.add_argument("--ray-version", default=RAY_VERSION)
    parser.add_argument("--dest", type=Path, default=ROOT / ".whl")
    parser.add_argument("--downloads", type=Path, default=Path(tempfile.gettempdir()) / "device-ray-wheel")
    parser.add_argument("--no-dependencies", action="store_true", help="the Ray wheel only")
    args = parser.parse_args()
    downloads = args.downloads / args.python
    [ray_wheel] = download([f"ray=={args.ray_version}"], args.python, downloads)
    args.dest.mkdir(parents=True, exist_ok=True)
    for old in args.dest.glob("ray-*.whl"):
        old.unlink()
    target = args.dest / ray_wheel.name
    counts = strip_wheel(ray_wheel, target)
    print(f"{ray_wheel.name}: {ray_wheel.stat().st_size / MIB:.1f} MiB -> {target.stat().st_size / MIB:.1f} MiB "
          f"({counts['kept']} files kept, {counts['dropped']} dropped, {counts['stripped']} ELF files stripped)")
    if not args.no_dependencies:
        for wheel in download(list(DEPENDENCIES), args.python, downloads):
            (args.dest / wheel.name).write_bytes(wheel.read_bytes())
            print(f"{wheel.name}: {wheel.stat().st_size / MIB:.2f} MiB")
    total = sum(p.stat().st_size for p in args.dest.glob("*.whl"))
    print(f"{args.dest}: {total / MIB:.1f} MiB of wheels")


if __name__ == "__main__":
    main()
