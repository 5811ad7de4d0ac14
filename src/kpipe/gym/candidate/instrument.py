"""Triton launch instrumentation: which kernels a candidate really launched.

The hacking check (paper §3.3) needs the exact names of the Triton kernels a forward pass
launched; the ghost replay needs every launch turned into a no-op. Both are done by
wrapping the one method every launch goes through:

- ``triton.runtime.jit.JITFunction.run`` for compiled kernels (``kernel[grid](...)`` goes
  through ``KernelInterface.__getitem__`` to ``run``; ``@triton.autotune`` and
  ``@triton.heuristics`` call the wrapped function's ``run``), on triton 3.x;
- ``triton.runtime.interpreter.InterpretedFunction.run`` under ``TRITON_INTERPRET=1``.

(``triton.knobs.runtime.launch_enter_hook`` also exists, but it never fires in interpreter
mode and cannot suppress a launch, so it is not used.) torch.compile's own Triton kernels
go through inductor's launcher, not ``run``: they are correctly not counted as generated.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


@dataclass
class LaunchLog:
    """Launches seen since the last reset; `seconds` is host time spent inside them (the
    CPU estimate of T_generated when the interpreter runs kernels on the host)."""

    names: list[str] = field(default_factory=list)
    seconds: float = 0.0
    per_kernel_seconds: dict[str, float] = field(default_factory=dict)

    def reset(self) -> None:
        self.names.clear()
        self.seconds = 0.0
        self.per_kernel_seconds = {}


LOG = LaunchLog()
# names the compiled kernels carry in the binary (what a GPU profiler shows), for every
# launch in this process; normally equal to the Python names, kept in case a Triton version
# decorates them
COMPILED_NAMES: set[str] = set()
_INSTALLED: dict[type, Callable[..., Any]] = {}


def kernel_name(kernel: Any) -> str:
    """The name the compiled kernel carries (and the profiler shows): the Python function's."""
    fn = getattr(kernel, "fn", None)
    return getattr(fn, "__name__", None) or getattr(kernel, "__name__", type(kernel).__name__)


def _launch_hooks() -> tuple[Callable[[Callable[..., Any]], Callable[..., Any]], Callable[[], Any]]:
    """The launch wrapper and the ghost replay's switch, sharing one flag that lives only in their
    closure: no module attribute says when launches are suppressed, so a candidate cannot read
    it by name to behave differently during the ghost replay (reaching a closure needs the
    introspection the static screen rejects; kpipe.gym.judge.screen)."""
    suppress = [False]

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            if warmup:
                return original(self, *args, grid=grid, warmup=warmup, **kwargs)
            if suppress[0]:
                return None
            name = kernel_name(self)
            start = time.perf_counter()
            try:
                result = original(self, *args, grid=grid, warmup=warmup, **kwargs)
            except BaseException as exc:
                exc.__kpipe_kernel__ = name  # type: ignore[attr-defined]  # kpipe.gym.candidate.faults reads it
                raise
            finally:
                spent = time.perf_counter() - start
                LOG.seconds += spent
                LOG.per_kernel_seconds[name] = LOG.per_kernel_seconds.get(name, 0.0) + spent
            # recorded only after a successful launch: a kernel that raised and was caught by a
            # fallback did not produce anything
            LOG.names.append(name)
            compiled_name = getattr(result, "name", None)
            if isinstance(compiled_name, str):
                COMPILED_NAMES.add(compiled_name)
            return result

        run.__kpipe_wrapped__ = True  # type: ignore[attr-defined]
        return run

    @contextmanager
    def suppressed() -> Iterator[None]:
        """Turn every Triton launch into a no-op inside the block (the ghost replay)."""
        install()
        suppress[0] = True
        try:
            yield
        finally:
            suppress[0] = False

    return wrap, suppressed


_wrap, suppressed = _launch_hooks()


def launch_classes() -> list[type]:
    """The classes whose ``run`` launches a kernel, in the installed triton."""
    from triton.runtime.jit import JITFunction

    classes: list[type] = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - triton without the interpreter
        return classes
    classes.append(InterpretedFunction)
    return classes


def install() -> None:
    """Wrap the launch methods (idempotent)."""
    for cls in launch_classes():
        if cls not in _INSTALLED:
            _INSTALLED[cls] = cls.run
            cls.run = _wrap(cls.run)


def uninstall() -> None:
    for cls, original in _INSTALLED.items():
        cls.run = original
    _INSTALLED.clear()


def installed_intact() -> bool:
    """False when someone replaced our wrappers after install (a candidate forging launches)."""
    return bool(_INSTALLED) and all(
        getattr(cls.run, "__kpipe_wrapped__", False) for cls in _INSTALLED
    )


@contextmanager
def recording() -> Iterator[LaunchLog]:
    """Record launches inside the block; yields a log of exactly those launches."""
    install()
    LOG.reset()
    seen = LaunchLog()
    try:
        yield seen
    finally:
        seen.names.extend(LOG.names)
        seen.seconds = LOG.seconds
        seen.per_kernel_seconds = dict(LOG.per_kernel_seconds)
        LOG.reset()
