"""The environment of every process KernelGym starts, built in one place.

An evaluation child (reference or candidate, forked from a warm zygote or started as a fresh
interpreter, on a pool worker, a Ray actor or behind the HTTP service) runs with what its
launcher's environment holds of an allowlist (``CHILD_NAMES``, ``CHILD_PREFIXES``: the toolchain,
the locale, CUDA's, torch's, Triton's and the thread pools' settings), minus anything that looks
like a credential, plus its device settings and its compile-cache directories
(``kpipe.gym.confine.compile_caches``). An allowlist, not a denylist: a candidate is hostile code, and
whatever else a run sets (its services' addresses, a scheduler's job variables, tokens under new
names) is none of its business.
The launching process builds it (``child_environment``) and hands it over whole: a forked
child must not rebuild it from its own ``os.environ`` after clearing it (that left children
with no ``PATH``, so gcc, Inductor's C++ compiler and ``CUDA_VISIBLE_DEVICES`` were lost).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

SECRET_MARKERS = ("_KEY", "_TOKEN", "SECRET", "PASSWORD", "CREDENTIAL")
SECRET_PREFIXES = ("OPENAI", "HF_", "AWS_", "ANTHROPIC", "HUGGING", "WANDB", "GITHUB_", "GH_", "AZURE_", "GOOGLE_")
# set per child by KernelGym, never inherited: where compiled artifacts are read and written
CACHE_VARIABLES = ("TRITON_CACHE_DIR", "TRITON_HOME", "TRITON_DUMP_DIR", "TRITON_OVERRIDE_DIR", "TORCHINDUCTOR_CACHE_DIR")
# settings that would let one evaluation load another's artifacts or a planted kernel
DROPPED_VARIABLES = ("TRITON_KERNEL_OVERRIDE", "TRITON_KERNEL_DUMP", "TRITON_CACHE_MANAGER", "TRITON_REMOTE_CACHE_BACKEND",
                     "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE", "TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE", "TORCHINDUCTOR_REMOTE_CACHE",
                     # the judge's per-evaluation trace file (kpipe.gym.judge.evaluation): no child may write to it
                     "KPIPE_GYM_TRACE")


# what an evaluation child may inherit from its launcher, by exact name or prefix: what compilers,
# the dynamic linker, Python, CUDA, torch, Triton and the thread pools read
CHILD_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "TERM", "TZ", "LANG", "LANGUAGE", "TMPDIR",
    "LD_LIBRARY_PATH", "LIBRARY_PATH", "CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH", "CC", "CXX",
    "PYTHONPATH", "PYTHONHASHSEED", "VIRTUAL_ENV", "CONDA_PREFIX",
})
CHILD_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "CUBLAS_", "CUDNN_", "TRITON_", "TORCHINDUCTOR_", "TORCH_", "PYTORCH_",
                  "OMP_", "KMP_", "MKL_", "OPENBLAS_")


def is_secret(name: str) -> bool:
    upper = name.upper()
    return any(m in upper for m in SECRET_MARKERS) or upper.startswith(SECRET_PREFIXES)


# shorter values ("1", "true") are settings, not secrets: replacing them would garble feedback
REDACT_MIN_CHARS = 8


def redact_secrets(text: str, environ: Mapping[str, str] | None = None) -> str:
    """`text` with the value of every secret variable of `environ` (this process's by default)
    replaced by ``[redacted NAME]``: the second line of defence behind the sandbox
    (kpipe.gym.confine.sandbox), applied to every diagnostic and feedback before it is stored or sent."""
    environ = os.environ if environ is None else environ
    secrets = sorted(((v, k) for k, v in environ.items() if is_secret(k) and len(v) >= REDACT_MIN_CHARS), key=lambda p: -len(p[0]))
    for value, name in secrets:
        if value in text:
            text = text.replace(value, f"[redacted {name}]")
    return text


def scrubbed_environment(env: Mapping[str, str]) -> dict[str, str]:
    """`env` without anything that looks like a credential."""
    return {k: v for k, v in env.items() if not is_secret(k)}


def inherited_by_children(name: str) -> bool:
    return (name in CHILD_NAMES or name.startswith(CHILD_PREFIXES)) and not is_secret(name) \
        and name not in CACHE_VARIABLES and name not in DROPPED_VARIABLES


def child_environment(device: str, parent: Mapping[str, str], caches: Mapping[str, str]) -> dict[str, str]:
    """An evaluation child's complete environment: what `parent` (the launching process's) holds
    of the allowlist (PATH, HOME, LD_LIBRARY_PATH, CUDA_VISIBLE_DEVICES, TRITON_*/TORCHINDUCTOR_*
    settings, ...), with `caches` (compile-cache variables) replacing any inherited cache location."""
    env = {k: v for k, v in parent.items() if inherited_by_children(k)}
    env.update(caches)
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def fork_server_environment(worker: Mapping[str, str]) -> dict[str, str]:
    """The environment a worker's fork server (``kpipe.gym.confine.zygote``) is started with: only what its
    children may inherit. A forked child's ``/proc/self/environ`` is the block its zygote was
    started with (clearing ``os.environ`` does not change it), so whatever else the worker holds
    (a database URL, a webhook, the run's ``KPIPE_*`` names) must never be in that block."""
    return {k: v for k, v in worker.items() if inherited_by_children(k)}


def worker_environment(parent: Mapping[str, str], gpu: str | None, cpu_threads: int | None) -> dict[str, str]:
    """A pool worker's environment: secrets scrubbed (the worker and its zygote never hold
    them), pinned to its GPU, and CUDA availability checked through NVML so nothing
    initialises CUDA before a fork."""
    env = scrubbed_environment(parent)
    env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    if gpu is None:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["TRITON_INTERPRET"] = "1"
    else:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    if cpu_threads:
        env["OMP_NUM_THREADS"] = str(cpu_threads)
    return env
