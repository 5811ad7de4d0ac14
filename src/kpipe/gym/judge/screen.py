"""Static screen (protocol step 1): cheap AST checks before anything runs.

Returns a format verdict (parse error, no ``ModelNew``, no ``@triton.jit`` kernel) and
policy findings. A finding is ``"<code>: <detail> (line N)"``; which codes reject a
candidate is the protocol's ``reject_findings``, the rest only inform.

A syntax error is reported as ``compilation_error`` (the source does not compile), a
missing ``ModelNew`` or kernel as ``format_error``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from kpipe.gym.protocol import FINDING_CODES

_MODULE_FINDINGS = {
    "threading": "thread",
    "_thread": "thread",
    "multiprocessing": "subprocess",
    "concurrent": "thread",
    "subprocess": "subprocess",
    "gc": "introspection",
    "inspect": "introspection",
    "kpipe": "introspection",  # the judge's own helpers, in the candidate's process
    "importlib": "introspection",
    "socket": "network",
    "urllib": "network",
    "http": "network",
    "requests": "network",
    "httpx": "network",
    "ctypes": "ctypes",
    "cffi": "ctypes",
    "shutil": "file_io",
    "pathlib": "file_io",
}
_CALL_FINDINGS = {
    "os.system": "subprocess",
    "os.popen": "subprocess",
    "os.fork": "subprocess",
    "os.kill": "subprocess",
    "os.killpg": "subprocess",
    "os.getenv": "env_access",
    "os.environ": "env_access",
    "os.environ.get": "env_access",
    "sys._getframe": "introspection",
    "sys.modules": "introspection",
    "sys.exit": "process_exit",
    "os._exit": "process_exit",
    "exit": "process_exit",
    "quit": "process_exit",
    "open": "file_io",
    "torch.cuda.Stream": "cuda_stream",
    "torch.cuda.stream": "cuda_stream",
    "setattr": "monkey_patch",
}
# attributes that reach a function's code, closure or globals, or the interpreter's objects: how a
# candidate would find the judge's state in its process
_INTROSPECTION_ATTRIBUTES = {"__closure__", "__globals__", "__code__", "__subclasses__", "__builtins__", "f_back", "f_globals",
                             "f_locals", "gi_frame", "tb_frame", "cell_contents"}
_PATCHABLE_ROOTS = {"torch", "triton", "tl", "time", "F", "nn", "builtins", "np", "numpy", "os", "sys"}
# torch calls that allocate or describe tensors rather than compute: not "torch ops left in forward"
_TORCH_NON_COMPUTE = {
    "empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones", "ones_like", "full",
    "full_like", "arange", "tensor", "device", "Size", "is_tensor", "numel", "no_grad",
    "float32", "float16", "bfloat16", "int32", "int64", "get_default_dtype",
}


@dataclass
class ScreenResult:
    status: str | None  # None = may run; else "format_error" | "compilation_error"
    diagnostic: str = ""
    findings: list[str] = field(default_factory=list)
    kernels: list[str] = field(default_factory=list)

    def codes(self) -> set[str]:
        return {f.split(":", 1)[0] for f in self.findings}


def dotted_name(node: ast.AST) -> str:
    """'torch.cuda.Stream' for the expression torch.cuda.Stream; '' if not a plain name chain."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def is_triton_jit(decorator: ast.AST) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return dotted_name(target) in ("triton.jit", "jit")


def triton_kernels(tree: ast.Module) -> list[str]:
    """Names of the module-level functions decorated with ``@triton.jit``."""
    return [
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and any(is_triton_jit(d) for d in node.decorator_list)
    ]


def _finding(code: str, detail: str, node: ast.AST) -> str:
    if code not in FINDING_CODES:
        raise ValueError(f"unregistered screen finding code {code!r}: add it to kpipe.gym.protocol.FINDING_CODES")
    return f"{code}: {detail} (line {getattr(node, 'lineno', '?')})"


def policy_findings(tree: ast.Module) -> list[str]:
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and node.handlers:
            found.append(_finding("try_except", "try/except around code", node))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for module in modules:
                code = _MODULE_FINDINGS.get(module.split(".")[0])
                if code:
                    found.append(_finding(code, f"imports {module}", node))
        elif isinstance(node, (ast.Call, ast.Attribute)) and not (
            isinstance(node, ast.Attribute) and isinstance(getattr(node, "ctx", None), ast.Store)
        ):
            name = dotted_name(node.func if isinstance(node, ast.Call) else node)
            code = _CALL_FINDINGS.get(name)
            if code and (isinstance(node, ast.Call) or name in ("os.environ", "sys.modules")):
                found.append(_finding(code, name, node))
        if isinstance(node, ast.Attribute) and node.attr in _INTROSPECTION_ATTRIBUTES:
            found.append(_finding("introspection", f"reaches .{node.attr}", node))
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                name = dotted_name(target) if isinstance(target, ast.Attribute) else ""
                if name and name.split(".")[0] in _PATCHABLE_ROOTS:
                    found.append(_finding("monkey_patch", f"assigns {name}", node))
        if isinstance(node, ast.ClassDef):
            bases = [dotted_name(b) for b in node.bases]
            if node.name == "ModelNew" and "Model" in bases:
                found.append(_finding("inherits_model", "class ModelNew(Model)", node))
            if any(b in ("torch.Tensor", "Tensor") for b in bases):
                found.append(_finding("tensor_subclass", f"class {node.name} subclasses Tensor", node))
        if isinstance(node, ast.FunctionDef) and node.name in ("__torch_function__", "__torch_dispatch__"):
            found.append(_finding("tensor_subclass", f"defines {node.name}", node))
    found.extend(torch_ops_in_forward(tree))
    return sorted(set(found), key=found.index)


def torch_ops_in_forward(tree: ast.Module) -> list[str]:
    """Torch compute calls in ``ModelNew.forward`` (torch.*, F.*, torch.nn.functional.*)."""
    found = []
    for cls in tree.body:
        if not (isinstance(cls, ast.ClassDef) and cls.name == "ModelNew"):
            continue
        for fn in cls.body:
            if not (isinstance(fn, ast.FunctionDef) and fn.name == "forward"):
                continue
            for node in ast.walk(fn):
                if not isinstance(node, ast.Call):
                    continue
                name = dotted_name(node.func)
                root, _, leaf = name.partition(".")
                if root in ("torch", "F") and leaf and name.rsplit(".", 1)[-1] not in _TORCH_NON_COMPUTE:
                    found.append(_finding("torch_op_in_forward", name, node))
    return found


def screen(source: str) -> ScreenResult:
    """Parse and screen a candidate program."""
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        return ScreenResult("compilation_error", f"SyntaxError: {exc.msg} (line {exc.lineno})")
    findings = policy_findings(tree)
    kernels = triton_kernels(tree)
    has_model = any(isinstance(n, ast.ClassDef) and n.name == "ModelNew" for n in tree.body)
    if not has_model:
        return ScreenResult("format_error", "no class ModelNew at module level", findings, kernels)
    if not kernels:
        return ScreenResult("format_error", "no @triton.jit kernel defined", findings, kernels)
    return ScreenResult(None, "", findings, kernels)
