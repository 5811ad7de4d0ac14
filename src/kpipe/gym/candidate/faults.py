"""Fault classification: which status an exception or a dead child process maps to."""

from __future__ import annotations

import signal

# substrings of CUDA error messages -> the GPU fault status they mean
CUDA_FAULTS = (
    ("illegal memory access", "illegal_memory_access"),
    ("misaligned address", "misaligned_address"),
    ("illegal instruction", "illegal_instruction"),
    ("device-side assert", "device_assert"),
    ("device side assert", "device_assert"),
)
OOM_MARKERS = ("out of memory", "can't allocate memory", "cannot allocate memory", "std::bad_alloc")
# errors the Triton compiler would have rejected before launch; under the interpreter they
# surface as exceptions from inside the launch, so they are classified the same way on both
STATIC_KERNEL_ERRORS = (NameError, AttributeError, TypeError, SyntaxError, AssertionError, ValueError)
TAIL_CHARS = 1500


def exception_chain(exc: BaseException) -> list[BaseException]:
    chain = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def is_triton_compile_error(exc: BaseException) -> bool:
    try:
        from triton.compiler.errors import CompilationError
        from triton.runtime.errors import OutOfResources, PTXASError
    except ImportError:  # pragma: no cover
        return False
    return isinstance(exc, (CompilationError, PTXASError, OutOfResources))


def classify_exception(exc: BaseException) -> tuple[str, str]:
    """(status, one-line summary) of an exception raised by candidate code."""
    summary = f"{type(exc).__name__}: {str(exc).strip()}"[:TAIL_CHARS]
    if isinstance(exc, SystemExit):
        return "crashed", f"the candidate called sys.exit({exc.code!r})"
    if isinstance(exc, KeyboardInterrupt):
        return "crashed", "KeyboardInterrupt raised by the candidate"
    chain = exception_chain(exc)
    text = " ".join(str(e) for e in chain).lower()
    for marker, status in CUDA_FAULTS:
        if marker in text:
            return status, summary
    if any(isinstance(e, MemoryError) for e in chain) or any(m in text for m in OOM_MARKERS):
        return "oom", summary
    if any(is_triton_compile_error(e) for e in chain):
        return "compilation_error", summary
    kernel = next((getattr(e, "__kpipe_kernel__") for e in chain if hasattr(e, "__kpipe_kernel__")), None)
    if kernel is not None:
        if any(isinstance(e, STATIC_KERNEL_ERRORS) for e in chain):
            return "compilation_error", f"in Triton kernel {kernel}: {summary}"
        return "runtime_error", f"in Triton kernel {kernel}: {summary}"
    if any(isinstance(e, SyntaxError) for e in chain):
        return "compilation_error", summary
    return "runtime_error", summary


def is_out_of_memory(text: str) -> bool:
    """Whether an error's text says a device or the host ran out of memory."""
    return any(marker in text.lower() for marker in OOM_MARKERS)


def classify_exit(returncode: int) -> tuple[str, str]:
    """(status, summary) of a child that exited without writing a result."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        if name == "SIGXFSZ":
            return "crashed", "killed by SIGXFSZ (output file too large)"
        return "crashed", f"killed by {name}"
    return "crashed", f"exited with code {returncode} without writing a result (os._exit or similar)"
