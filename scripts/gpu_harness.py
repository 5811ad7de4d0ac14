"""What every GPU check in scripts/ does alike, written once: empty compile caches, the device's
facts for a report's header, the report under $OUT, and an exit status that says whether what the
check checks held. A check imports it as ``gpu_harness`` (scripts/ is on the path of a script run
as ``python scripts/gpu_check_*.py``).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

COMPILE_CACHES = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")


def cold_caches(move_home: bool = True) -> dict[str, str]:
    """Fresh, empty compile caches for this process and everything it starts, so that a check cannot
    pass on kernels an earlier run compiled. Triton and Inductor read the variables when imported,
    hence the refusal once they are; `move_home` also puts ~/.triton aside (never on a shared machine)."""
    loaded = [name for name in ("torch", "triton") if name in sys.modules]
    if loaded:
        raise RuntimeError(f"{loaded} imported before the compile caches were set")
    fresh = {name: tempfile.mkdtemp(prefix=f"cold-{name.lower()}-") for name in COMPILE_CACHES}
    os.environ.update(fresh)
    home_triton = Path.home() / ".triton"
    if move_home and home_triton.exists():
        home_triton.rename(home_triton.with_name(f".triton.aside-{int(time.time())}"))
    return fresh


def device_facts() -> dict[str, str]:
    """The device and software a result holds for: every report names them, with the time it ran."""
    import torch
    import triton

    return {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda or "none",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def facts_line(facts: dict[str, str]) -> str:
    return (f"{facts['date']} on {facts['device']}; torch {facts['torch']} (CUDA {facts['cuda']}), "
            f"triton {facts['triton']}")


def out_dir(default: Path | None = None) -> Path | None:
    """Where reports go: $OUT on the device machine (what comes back from it), else `default`."""
    return Path(os.environ["OUT"]) if os.environ.get("OUT") else default


def write_report(stem: str, markdown: str | None = None, data: Any = None, default: Path | None = None) -> None:
    """`stem`.md and `stem`.json (whichever is given) under `out_dir(default)`; nothing when there is
    no such folder. Checks write after each part, so a call stopped at its time limit keeps what ran."""
    out = out_dir(default)
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    if markdown is not None:
        (out / f"{stem}.md").write_text(markdown)
    if data is not None:
        (out / f"{stem}.json").write_text(json.dumps(data, indent=2, default=str))


def exit_status(failures: Iterable[str]) -> int:
    """0 when nothing failed, else 1 after naming each failure on stderr: a device call's exit code
    is what a reader of its log sees first."""
    failed = list(failures)
    for failure in failed:
        print(f"FAIL: {failure}", file=sys.stderr, flush=True)
    return 1 if failed else 0
