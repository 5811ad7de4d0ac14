"""Record the parts of vLLM's interface kpipe uses, read from a vLLM wheel without installing it.

vLLM needs CUDA and a long list of packages, so neither CI nor our CPU machines can import it.
Its CLI flags, constructor arguments and dataclass fields are plain Python in the wheel, so this
script reads them from the source with `ast` (nothing is imported or executed) and writes
`tests/data/vllm_api-<version>.json`, one file per release the `vllm` extra pins;
`tests/test_vllm_api.py` checks kpipe's `vllm serve` flags, `LLM` arguments, `SamplingParams`
fields, output fields and environment variables against every one of them.

    pip download vllm==0.33.0 --no-deps -d /tmp/v
    python scripts/vllm_api_record.py /tmp/v/vllm-0.33.0-*.whl    # -> tests/data/vllm_api-0.33.0.json

What it reads (paths inside the wheel; recorded for 0.26.0 and 0.33.0):
- `vllm serve` flags: the `add_argument` literals of `EngineArgs.add_cli_args` and
  `AsyncEngineArgs.add_cli_args` (engine/arg_utils.py) and of `make_arg_parser`
  (entrypoints/common/cli_args.py; entrypoints/openai/cli_args.py up to 0.26), plus `--<field>` of
  `BaseFrontendArgs`/`FrontendArgs`, whose flags vLLM derives from the dataclass fields;
- `LLM.__init__` parameters (entrypoints/llm.py) and `EngineArgs` fields (its `**kwargs` become
  `EngineArgs`), and the parameters of the `LLM` methods kpipe calls;
- `SamplingParams` fields, `CompletionOutput` fields, `RequestOutput.__init__` parameters,
  the `LogprobsMode` and `DistributedExecutorBackend` values, the environment variables of envs.py,
  and the methods both GPU model runners (V1 and V2) define.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import zipfile
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
LLM_METHODS = ("chat", "collective_rpc", "reset_prefix_cache", "sleep", "wake_up")
MODEL_RUNNERS = ("vllm/v1/worker/gpu_model_runner.py", "vllm/v1/worker/gpu/model_runner.py")
# where `make_arg_parser` and the frontend dataclasses live: moved out of entrypoints/openai after 0.26
CLI_ARGS = ("vllm/entrypoints/common/cli_args.py", "vllm/entrypoints/openai/cli_args.py")


def parse(wheel: zipfile.ZipFile, path: str) -> ast.Module:
    return ast.parse(wheel.read(path).decode(), filename=path)


def parse_first(wheel: zipfile.ZipFile, paths: tuple[str, ...]) -> ast.Module:
    """The first of `paths` the wheel holds (a module that moved between releases)."""
    names = set(wheel.namelist())
    for path in paths:
        if path in names:
            return parse(wheel, path)
    raise LookupError(f"none of {paths} in the wheel")


def find_class(module: ast.Module, name: str) -> ast.ClassDef:
    for node in ast.walk(module):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise LookupError(f"class {name} not found")


def find_function(scope: ast.AST, name: str) -> ast.FunctionDef:
    for node in ast.walk(scope):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise LookupError(f"function {name} not found")


def dash_literals(scope: ast.AST) -> set[str]:
    """The option strings of every `add_argument(...)` call in `scope`."""
    flags = set()
    for node in ast.walk(scope):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            flags |= {arg.value for arg in node.args
                      if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("--")}
    return flags


def positional_names(scope: ast.AST) -> list[str]:
    """The positional arguments (`add_argument("name", ...)`) registered in `scope`."""
    names = []
    for node in ast.walk(scope):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str) and not first.value.startswith("-"):
                names.append(first.value)
    return names


def fields(cls: ast.ClassDef) -> list[str]:
    """Annotated attributes in a (data)class body, in order."""
    return [node.target.id for node in cls.body
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)]


def parameters(function: ast.FunctionDef) -> list[str]:
    args = function.args
    return [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs) if a.arg != "self"]


def methods(cls: ast.ClassDef) -> set[str]:
    return {node.name for node in cls.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def literal_values(module: ast.Module, alias: str) -> list[str]:
    """The string values of `alias = Literal[...]` at module level."""
    for node in module.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == alias for t in node.targets):
            return [c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
    raise LookupError(f"{alias} not found")


def record(wheel_path: Path) -> dict[str, object]:
    with zipfile.ZipFile(wheel_path) as wheel:
        version = re.search(r"__version__\s*=\s*version\s*=\s*['\"]([^'\"]+)", wheel.read("vllm/_version.py").decode())
        arg_utils = parse(wheel, "vllm/engine/arg_utils.py")
        cli_args = parse_first(wheel, CLI_ARGS)
        llm = find_class(parse(wheel, "vllm/entrypoints/llm.py"), "LLM")
        outputs = parse(wheel, "vllm/outputs.py")
        envs = parse(wheel, "vllm/envs.py")
        runners = [find_class(parse(wheel, path), "GPUModelRunner") for path in MODEL_RUNNERS]
        engine_args = find_class(arg_utils, "EngineArgs")
        make_parser = find_function(cli_args, "make_arg_parser")
        serve_flags = (dash_literals(find_function(engine_args, "add_cli_args"))
                       | dash_literals(find_function(find_class(arg_utils, "AsyncEngineArgs"), "add_cli_args"))
                       | dash_literals(make_parser)
                       | {f"--{name.replace('_', '-')}" for cls in ("BaseFrontendArgs", "FrontendArgs")
                          for name in fields(find_class(cli_args, cls))})
        return {
            "version": version.group(1) if version else None,
            "wheel": wheel_path.name,
            "serve_flags": sorted(serve_flags),
            "serve_positionals": positional_names(make_parser),
            "llm_init_params": parameters(find_function(llm, "__init__")),
            "engine_args_fields": fields(engine_args),
            "llm_methods": {name: parameters(find_function(llm, name)) for name in LLM_METHODS},
            "sampling_params_fields": fields(find_class(parse(wheel, "vllm/sampling_params.py"), "SamplingParams")),
            "logprobs_modes": literal_values(parse(wheel, "vllm/config/model.py"), "LogprobsMode"),
            "executor_backends": literal_values(parse(wheel, "vllm/config/parallel.py"), "DistributedExecutorBackend"),
            "completion_output_fields": fields(find_class(outputs, "CompletionOutput")),
            "request_output_params": parameters(find_function(find_class(outputs, "RequestOutput"), "__init__")),
            "env_vars": sorted({node.target.id for node in ast.walk(envs)
                                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                                and node.target.id.startswith("VLLM_")}),
            "model_runner_methods": sorted(set.intersection(*(methods(runner) for runner in runners))),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", type=Path, help="a vllm-*.whl (pip download vllm==X --no-deps)")
    parser.add_argument("--out", type=Path, help="default: tests/data/vllm_api-<version>.json")
    args = parser.parse_args()
    api = record(args.wheel)
    out = args.out or DATA / f"vllm_api-{api['version']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(api, indent=1, sort_keys=True) + "\n")
    print(f"vLLM {api['version']}: {len(api['serve_flags'])} serve flags, "  # type: ignore[arg-type]
          f"{len(api['engine_args_fields'])} EngineArgs fields -> {out}")  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
