"""Code versions: a stage reruns when the library code it runs changes, and only then."""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # src/kpipe


@cache
def code_version(*parts: str) -> str:
    """Hash of the kpipe sources named by `parts` (subpackages or modules, e.g. "data", "data/db.py").

    Snakemake records it as a rule param, so editing `kpipe/gym` reruns the stages that
    evaluate kernels but not ingest. Package data (vendored problem sets, the bank) counts.
    """
    digest = hashlib.sha256()
    for part in sorted(set(parts)):
        root = PACKAGE_ROOT / part
        if not root.exists():
            raise FileNotFoundError(f"code_version: no kpipe part {part!r} at {root}")
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
        for path in files:
            digest.update(str(path.relative_to(PACKAGE_ROOT)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:12]
