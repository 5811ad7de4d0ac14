"""Compile caches that no evaluation can plant an artifact in for another.

Triton and Inductor load compiled artifacts from cache directories by content key: whoever
can write there decides what a later process runs. Candidates run as the same user as
everything else (often root on a GPU box), so file permissions cannot keep them out of a
shared cache, and a planted entry could make another candidate fail or slow the
``torch.compile`` baseline (inflating every speedup against it). The layout:

- **candidate children** compile into a private directory inside their scratch directory,
  deleted with it: nothing a candidate writes is ever read by another evaluation. It is seeded
  with a copy (never a link) of the trusted Triton cache's host-code entries, so Triton's
  runtime helpers (``cuda_utils``, kernel launchers: built by gcc) are not rebuilt per candidate,
  and of the judge's own kernels (the timing windows' sketch, ``JUDGE_KERNEL_NAMES``), which the
  reference child of the same task built, so no candidate pays their compilation;
- **reference children** (outputs, eager and ``torch.compile`` baselines) share one trusted
  directory per launching process (a pool worker, or the ``kpipe gym eval`` process). That
  process never runs candidate code and keeps, in its own memory, the digest of every file the
  trusted children left there; before each use the directory is re-hashed, and if anything was
  added, changed or replaced by a link since, the whole directory is wiped and rebuilt from
  scratch (the cost is one recompilation of the baselines). Files whose inode, size, mtime and
  ctime are unchanged keep their digest without being re-read.

The trusted directory lives as long as its process: a digest kept on disk could be rewritten
by the same candidates it guards against.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

Manifest = dict[str, str]


def cache_variables(directory: Path) -> dict[str, str]:
    """Every variable through which Triton or Inductor pick a cache location, under `directory`."""
    return {
        "TRITON_CACHE_DIR": str(directory / "triton"),
        "TRITON_HOME": str(directory / "home"),  # ~/.triton's dump and override folders
        "TRITON_DUMP_DIR": str(directory / "home" / "dump"),
        "TRITON_OVERRIDE_DIR": str(directory / "home" / "override"),
        "TORCHINDUCTOR_CACHE_DIR": str(directory / "inductor"),
    }


StatKey = tuple[int, int, int, int]
_digests: dict[tuple[str, StatKey], str] = {}  # (path, stat) -> digest: unchanged files are not re-read


def file_digest(path: Path) -> str:
    """Content digest, re-read only when the file's inode, size, mtime or ctime changed (ctime
    cannot be set back from user space, so a rewrite that restores mtime is still seen)."""
    st = path.stat()
    key = (str(path), (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    if key not in _digests:
        _digests[key] = hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest()
    return _digests[key]


def snapshot(directory: Path) -> Manifest:
    """Relative path -> content digest of every entry under `directory`; a symbolic link
    (which no compiler writes) is recorded as such, so it never matches a digest."""
    manifest: Manifest = {}
    if not directory.exists():
        return manifest
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = Path(root) / name
            relative = str(path.relative_to(directory))
            if path.is_symlink():
                manifest[relative] = "symlink"
            elif path.is_file():
                manifest[relative] = file_digest(path)
            elif not path.is_dir():
                manifest[relative] = "special"
    return manifest


# Triton kernels that the judge's code runs inside every child (kpipe.gym.candidate.sketch_kernel.KERNEL_NAME):
# a trusted child's build of them is handed to candidates. Triton names a kernel's files after it
JUDGE_KERNEL_NAMES = frozenset({"kgym_output_sketch"})


def seeded_entries(triton_cache: Path) -> list[Path]:
    """The Triton cache entries a candidate's private cache starts with: those that hold compiled host
    code (``cuda_utils``, kernel launchers: the ``.so`` files gcc builds), which any kernel may need,
    and the judge's own kernels; other compiled kernels (the baselines') are left out."""
    if not triton_cache.is_dir():
        return []

    def wanted(entry: Path) -> bool:
        return any(f.suffix == ".so" or f.name.split(".")[0].removeprefix("__grp__") in JUDGE_KERNEL_NAMES
                   for f in entry.iterdir())

    return sorted(entry for entry in triton_cache.iterdir() if entry.is_dir() and wanted(entry))


def copy_entry(entry: Path, destination: Path) -> None:
    """A copy of a Triton cache entry whose group files (``__grp__*.json``: the absolute paths of the
    entry's files, which Triton opens as they are) name the copy's files, not the trusted ones, which a
    candidate's child cannot read."""
    shutil.copytree(entry, destination, symlinks=True)
    for group in destination.glob("__grp__*.json"):
        data = json.loads(group.read_text())
        if isinstance(data.get("child_paths"), dict):
            data["child_paths"] = {name: str(destination / Path(path).name) for name, path in data["child_paths"].items()}
            group.write_text(json.dumps(data))


def foreign_entries(before: Manifest, now: Manifest) -> list[str]:
    """Entries of `now` that the trusted children did not leave as they are (added, changed,
    or turned into links); entries that disappeared are harmless (they are recompiled)."""
    return sorted(path for path, digest in now.items() if before.get(path) != digest or digest in ("symlink", "special"))


class CompileCaches:
    """The trusted cache of one launching process, and private caches for candidates."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="kgym-caches-"))
        self.trusted = self.root / "trusted"
        self.trusted.mkdir(parents=True, exist_ok=True)
        self._manifest: Manifest = snapshot(self.trusted)
        self.wipes = 0  # how often tampering was found (reported by benchmarks and tests)
        self.verify_s = 0.0  # time spent hashing, the design's running cost
        if root is None:
            atexit.register(shutil.rmtree, self.root, True)

    def verify(self) -> list[str]:
        """Wipe the trusted directory if anything in it was not left there by a trusted child;
        returns what was foreign."""
        started = time.perf_counter()
        foreign = foreign_entries(self._manifest, snapshot(self.trusted))
        if foreign:
            log.warning("KernelGym: %d foreign entries in the trusted compile cache (e.g. %s); wiping it", len(foreign), foreign[0])
            shutil.rmtree(self.trusted, ignore_errors=True)
            self.trusted.mkdir(parents=True, exist_ok=True)
            self._manifest = {}
            self.wipes += 1
        self.verify_s += time.perf_counter() - started
        return foreign

    def for_reference(self) -> dict[str, str]:
        """Cache variables of a reference child: the verified trusted directory. Call
        ``seal()`` once the child has exited."""
        self.verify()
        return cache_variables(self.trusted)

    def seal(self) -> None:
        """Record what the trusted child that just exited left in the trusted directory."""
        self._manifest = snapshot(self.trusted)

    def for_candidate(self, private: Path) -> dict[str, str]:
        """Cache variables of a candidate child: `private` (inside its scratch directory),
        seeded with a copy of the verified trusted Triton cache's runtime helpers and judge's kernels."""
        self.verify()
        for entry in seeded_entries(self.trusted / "triton"):
            copy_entry(entry, private / "triton" / entry.name)
        return cache_variables(private)


_process_caches: CompileCaches | None = None


def process_caches() -> CompileCaches:
    """This process's compile caches (one trusted directory per launching process)."""
    global _process_caches
    if _process_caches is None:
        _process_caches = CompileCaches()
    return _process_caches
