"""The files a child writes for the judge, and how the judge reads them.

A file is safetensors: the tensors, and under its metadata key ``document`` a JSON document holding
everything else, each tensor in it as ``{"$tensor": name}``. No pickle: reading a file runs no code
of the writer's, and the judge parses it in bounded time and memory (a size cap before reading,
a header cap, a depth and a node count while walking). Then every file is held to a strict schema
(``check``): the exact keys, types and counts the judge expects, so a judge that reads it afterwards
never meets a value of the wrong kind. A file that fails either step is ``MalformedFile``: a
candidate's failure, named in its diagnostic, never an exception that reaches the batch.

The exchange's file names, the window poll and ``gc_paused`` are here too: the judge's side
(``kpipe.gym.confine.isolate``) and the candidate's (``kpipe.gym.candidate.child``) both use them,
and neither imports the other.
"""

from __future__ import annotations

import contextlib
import gc
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

TENSOR_KEY = "$tensor"
DOCUMENT_KEY = "document"
MAX_DEPTH = 12  # the deepest document the judge's schemas describe is 6 levels
MAX_NODES = 1 << 20
MAX_HEADER_BYTES = 64 << 20  # safetensors' header: a JSON object naming each tensor, and the document

# the files a child and the judge exchange in the child's scratch directory
JOB_FILE = "job.json"
PREPARATION_FILE = "preparation.json"  # a child started ahead of its job (kpipe.gym.confine.zygote)
RESULT_FILE = "result.safetensors"
PARTIAL_FILE = "partial.safetensors"
PHASE_FILE = "phase"
GATE_FILE = "gate"
# a timing window each (``.format(round=...)``)
WINDOW_READY_FILE = "window-ready-{round}"
WINDOW_FILE = "window-{round}"
WINDOW_ANSWER_FILE = "window-{round}.safetensors"
PHASE_MAX_BYTES = 200
WINDOW_POLL_S = 0.0002  # the judge's clock on a window is this fine, and so is the child's wait for its seed


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No garbage collection inside: a full collection of a process holding torch and Triton takes
    0.1-0.2 s, which a clock around it (a timing window's, on both sides) would charge to the
    candidate."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class MalformedFile(ValueError):
    """A child's file that is not a well-formed exchange file, or not of its schema."""


def encode(payload: dict[str, Any]) -> bytes:
    """`payload` (dicts with string keys, lists, str, int, float, bool, None, tensors) as bytes."""
    import safetensors.torch

    tensors: dict[str, torch.Tensor] = {}

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            name = f"t{len(tensors)}"
            # a copy of its own: safetensors refuses tensors that share memory (rows of one buffer)
            tensors[name] = value.detach().as_subclass(torch.Tensor).to("cpu", copy=True).contiguous()
            return {TENSOR_KEY: name}
        if isinstance(value, dict):
            return {str(key): walk(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [walk(item) for item in value]
        if value is None or isinstance(value, (str, int, float, bool)):
            return value
        raise TypeError(f"an exchange file holds no {type(value).__name__}")

    document = json.dumps(walk(payload), allow_nan=True)
    return safetensors.torch.save(tensors, metadata={DOCUMENT_KEY: document})


def decode(data: bytes) -> Any:
    """The payload `data` encodes; ``MalformedFile`` naming why when it is not one."""
    import safetensors.torch

    if len(data) < 8:
        raise MalformedFile("shorter than a safetensors header")
    (header_bytes,) = struct.unpack("<Q", data[:8])
    if header_bytes > min(MAX_HEADER_BYTES, len(data) - 8):
        raise MalformedFile(f"a header of {header_bytes} bytes")
    try:
        header = json.loads(data[8:8 + header_bytes])
        document_text = header["__metadata__"][DOCUMENT_KEY]
        tensors = safetensors.torch.load(data)
        document = json.loads(document_text)
    except RecursionError:
        raise MalformedFile("nested too deep") from None
    except Exception as exc:  # noqa: BLE001 - whatever the parser refuses is the writer's fault
        raise MalformedFile(f"unreadable ({type(exc).__name__}: {str(exc)[:200]})") from None
    nodes = [0]

    def resolve(value: Any, depth: int) -> Any:
        nodes[0] += 1
        if depth > MAX_DEPTH or nodes[0] > MAX_NODES:
            raise MalformedFile(f"deeper than {MAX_DEPTH} or more than {MAX_NODES} values")
        if isinstance(value, dict):
            if set(value) == {TENSOR_KEY}:
                if not isinstance(value[TENSOR_KEY], str) or value[TENSOR_KEY] not in tensors:
                    raise MalformedFile("a reference to no tensor")
                return tensors[value[TENSOR_KEY]]
            return {key: resolve(item, depth + 1) for key, item in value.items()}
        if isinstance(value, list):
            return [resolve(item, depth + 1) for item in value]
        return value

    return resolve(document, 0)


# ----------------------------------------------------------------------------- schemas


@dataclass(frozen=True)
class ListOf:
    """A list of at most `most` items of `item` (exactly `exactly` when given)."""

    item: Any
    most: int = 1 << 16
    exactly: int | None = None


@dataclass(frozen=True)
class Record:
    """A dict with exactly these keys (`optional` ones may be missing), each of its schema."""

    fields: dict[str, Any]
    optional: frozenset[str] = frozenset()


@dataclass(frozen=True)
class OneOf:
    """Any one of `choices`."""

    choices: tuple[Any, ...]


TENSOR = torch.Tensor
STRING_MAX_CHARS = 1 << 16
# instrumentation (a child's phase seconds, memory): any JSON value the decoder let through, never judged
ANY = object()


def check(value: Any, schema: Any, where: str = "file") -> None:
    """``MalformedFile`` naming the first place `value` departs from `schema`: a type (``int``,
    ``float`` (ints accepted), ``str``, ``bool``, ``TENSOR``), ``ListOf``, ``Record``, ``OneOf``
    or ``ANY``. bools are not ints here, and strings are at most ``STRING_MAX_CHARS``."""
    if schema is ANY:
        return
    if isinstance(schema, OneOf):
        failures = []
        for choice in schema.choices:
            try:
                check(value, choice, where)
                return
            except MalformedFile as exc:
                failures.append(str(exc))
        raise MalformedFile(f"{where}: none of its forms ({'; '.join(failures)[:300]})")
    if isinstance(schema, ListOf):
        if not isinstance(value, list) or len(value) > schema.most or (schema.exactly is not None and len(value) != schema.exactly):
            count = schema.exactly if schema.exactly is not None else f"at most {schema.most}"
            raise MalformedFile(f"{where}: expected a list of {count} items")
        for index, item in enumerate(value):
            check(item, schema.item, f"{where}[{index}]")
        return
    if isinstance(schema, Record):
        if not isinstance(value, dict):
            raise MalformedFile(f"{where}: expected a record")
        unknown = sorted(set(value) - set(schema.fields))
        missing = sorted(set(schema.fields) - set(value) - schema.optional)
        if unknown or missing:
            raise MalformedFile(f"{where}: unexpected keys {unknown[:5]}, missing {missing[:5]}")
        for key, item in value.items():
            check(item, schema.fields[key], f"{where}.{key}")
        return
    if schema is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif schema is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, schema)
    if not ok or (schema is str and len(value) > STRING_MAX_CHARS):
        raise MalformedFile(f"{where}: expected {getattr(schema, '__name__', schema)}")


def parsed(data: bytes, schema: Any) -> Any:
    """`data` decoded and held to `schema` (``MalformedFile`` otherwise)."""
    value = decode(data)
    check(value, schema)
    return value
