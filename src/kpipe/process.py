"""Process hygiene shared by everything that starts a helper process (evaluation children,
``vllm serve``): a helper must not outlive the process that supervises it."""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent: int, signum: int = signal.SIGKILL) -> None:
    """Ask the kernel to send `signum` to this process when `parent` (the process that started
    it and enforces its timeout) dies, also by SIGKILL: an orphan would otherwise keep its GPU
    memory. Call it in the child (``preexec_fn`` or right after ``fork``). Linux only; elsewhere
    the parent's own clean-up is the only guard."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the request took effect
        os._exit(1)
