"""Code versions and restart keys: a stage reruns when what it runs changes, and only then; a
stage that resumes reuses partial work only when everything that work depends on is unchanged."""

from __future__ import annotations

import ast
import hashlib
import json
import os
from collections.abc import Mapping
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # src/kpipe

# The code the resumable training stages run: their rules' `code` param and the `code` part of
# their restart key (a checkpoint of other code is never resumed).
SFT_CODE = ("train/sft.py", "train/samples.py", "train/batching.py", "train/checkpoint.py", "train/metrics_log.py",
            "data/io.py", "data/schemas.py", "infra/launch.py", "infra/jobs.py", "infra/provenance.py")
RL_CODE = ("train", "agent", "llm", "gym", "data/io.py", "data/schemas.py", "infra/launch.py", "infra/jobs.py",
           "infra/provenance.py")
# Libraries whose version can change what training computes (absent ones: "-")
KEY_LIBRARIES = ("torch", "transformers", "triton", "accelerate", "vllm", "kpipe")
EDGE_BYTES = 1 << 20  # a weight file is identified by its size and its first and last MiB


def _canonical(node: Any) -> str:
    """A syntax tree as text: node types and field values, no positions; a field that is None or
    empty is left out, so the text is the same on every Python that parses the code alike (3.12
    added empty `type_params`, 3.13's `ast.dump` omits empty fields)."""
    if isinstance(node, ast.AST):
        fields = ((name, getattr(node, name, None)) for name in node._fields)
        return f"{type(node).__name__}({','.join(f'{name}={_canonical(value)}' for name, value in fields if value not in (None, []))})"
    if isinstance(node, list):
        return f"[{','.join(_canonical(item) for item in node)}]"
    return repr(node)


def _without_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return tree


def source_digest(path: Path) -> str:
    """Hash of what a file can do: for Python, its syntax tree without docstrings (comments,
    docstrings and formatting change nothing a run computes); for any other file, its bytes. A
    Python file that does not parse counts by its bytes (its job then fails with the real error)."""
    data = path.read_bytes()
    if path.suffix == ".py":
        try:
            data = _canonical(_without_docstrings(ast.parse(data, filename=str(path)))).encode()
        except (SyntaxError, ValueError):
            pass
    return hashlib.sha256(data).hexdigest()


@cache
def code_version(*parts: str) -> str:
    """Hash of the kpipe sources named by `parts` (subpackages or modules, e.g. "data", "data/db.py"),
    each by `source_digest`.

    Snakemake records it as a rule param, so editing `kpipe/gym` reruns the stages that
    evaluate kernels but not ingest, and editing a comment or docstring reruns nothing. Package
    data (vendored problem sets, the bank) counts.
    """
    digest = hashlib.sha256()
    for part in sorted(set(parts)):
        root = PACKAGE_ROOT / part
        if not root.exists():
            raise FileNotFoundError(f"code_version: no kpipe part {part!r} at {root}")
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
        for path in files:
            digest.update(str(path.relative_to(PACKAGE_ROOT)).encode())
            digest.update(source_digest(path).encode())
    return digest.hexdigest()[:12]


def job_code_version(script: Path, *parts: str) -> str:
    """A rule's `code` param: `code_version` of the kpipe `parts` its job runs and the digest of its
    script (workflow/scripts/<rule>.py)."""
    return f"{code_version(*parts)}-{source_digest(script)[:12]}"


def library_versions() -> dict[str, str]:
    """Installed versions of KEY_LIBRARIES, read from their metadata (nothing is imported)."""
    versions = {}
    for name in KEY_LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "-"
    return versions


@cache
def judge_version() -> str:
    """kpipe's KernelGym code and the torch and Triton versions: part of every cached evaluation's key
    (the result cache, a job's replay cache), so a rerun after a change of the judge evaluates again
    instead of replaying verdicts and timings of the old one."""
    versions = library_versions()
    return f"{code_version('gym')}/torch-{versions['torch']}/triton-{versions['triton']}"


def weights_identity(path: str | os.PathLike | None) -> str:
    """Identity of a model or state folder (or file): every file's name, size and first and last
    MiB, so a retrained or replaced model differs while a copy (new times) does not; cheap for
    weights of any size. A path that is not a local file or folder (a hub id) stands for itself."""
    if path is None:
        return "none"
    path = Path(path)
    if not path.exists():
        return f"name:{path}"
    digest = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.relative_to(path) if file != path else file.name}:{size}".encode())
        with file.open("rb") as handle:
            digest.update(handle.read(EDGE_BYTES))
            if size > EDGE_BYTES:
                handle.seek(max(EDGE_BYTES, size - EDGE_BYTES))
                digest.update(handle.read())
    return digest.hexdigest()[:16]


def hub_weights_identity(name_or_path: str) -> str:
    """weights_identity of a local model folder, else of the hub model's cached snapshot (its
    folder is named by the revision's commit); the bare id when it is not in the local cache."""
    if Path(name_or_path).exists():
        return weights_identity(name_or_path)
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return weights_identity(name_or_path)
    config = try_to_load_from_cache(name_or_path, "config.json")
    return weights_identity(Path(config).parent if isinstance(config, str) else name_or_path)


def restart_key(**parts: Any) -> dict[str, str]:
    """A restart key: each named part (settings, data, code, weights, libraries...) as a short
    hash of its JSON, kept apart so a mismatch can say which part changed."""
    return {name: hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]
            for name, value in sorted(parts.items())}


def key_changes(stored: Mapping[str, str] | None, key: Mapping[str, str]) -> str:
    """Why partial work keyed by `stored` is not that of `key` ("" when it is): the parts that
    changed, e.g. "code, weights changed"."""
    if not stored:
        return "it carries no restart key (written by an older kpipe)"
    changed = sorted(name for name in set(stored) | set(key) if stored.get(name) != key.get(name))
    return f"{', '.join(changed)} changed" if changed else ""
