"""vLLM 0.26.0 on one GPU, every path kpipe has (issue 29): the version and attention backend it runs,
generation throughput against kpipe's HF engine, the rollout/trainer mismatch MRS is for, and
`serve: vllm` with an evaluation and a distillation call through kpipe's OpenAI engine.

    # vLLM installed into /tmp/site as docs/vllm-on-the-device.md says (3 calls), then in call 3:
    export PYTHONPATH=$PWD/src:/tmp/site PATH=/tmp/site/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0 \\
        VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
    python3 -m checks.gpu vllm                 # sections version throughput mismatch serve, ~6-7 min
    python3 -m checks.gpu rl_learns --engine vllm --iterations 3    # the RL run, a call of its own

Policies: the DAG's nano policy (``kpipe.train.tiny_model.tiny_model_job``, nano, 4,000-token BPE:
head_dim 16) and a Qwen3-0.6B-sized one (the ``qwen3-0.6b`` preset of the same builder, random
weights, the nano policy's tokenizer, so one embedding row per token: 4,000 rows instead of Qwen's
151,936). Every vLLM engine runs in a child process of its own (``python -m checks.gpu.vllm CHILD
SPEC``) so that its GPU memory is freed when it ends, built as kpipe's RL builds it:
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``kpipe.train.rollouts.vllm_engine_args`` (processed
log-probs, ``max_model_len`` = rl.max_context_tokens) with ``gpu_memory_utilization`` 0.3, through
``kpipe.llm.vllm_engine.VLLMEngine`` (``LLM.chat``).

Sections (each fails alone; a later one still runs):

1. ``version``: builds the policies, starts one vLLM engine per policy (the nano one retried on
   ``FLEX_ATTENTION`` if the default backend cannot start), and reports vLLM's and torch's versions, the
   GPU, the attention backend and FlashAttention version vLLM logged for each policy, and each engine's
   start-up seconds (from empty compile caches: vLLM's torch.compile of the model (Dynamo + Inductor,
   Triton kernels) and its CUDA-graph capture, both inside ``LLM(...)``).
2. ``throughput``: tokens/s of vLLM and of ``kpipe.llm.hf_engine.HFEngine`` (bf16 weights) on the
   same first-turn prompts of the bank's tasks (``first_turn_messages`` of each task's KernelBench
   reference), batch 16 and 64, max_tokens 256, temperature 1, log-probs on (as RL asks), one warm-up
   call first. Passes when vLLM reaches 5x HF at batch 64 for at least one policy.
3. ``mismatch``: per-sequence importance ratios w = pi_train/pi_rollout (geometric mean over the
   tokens, Eq. 6) of 64 sequences per engine, the trainer's log-probs recomputed exactly as kpipe's RL
   does (``load_policy``: fp32 weights, ``policy_log_probs`` under ``Accelerator(mixed_precision=
   "bf16").autocast()``), MRS rejections by ``kpipe.train.rl_batch.mismatch_keep`` at the paper's
   thresholds (RLConfig defaults: |w - 1| <= 1e-3, token veto 1e-4), rollout and trainer perplexity.
   Two policies: the random nano policy and the same after 30 quick training steps on the bank's
   legit kernels ("trained"; pushed into the running vLLM engine by ``push_weights_to_vllm``, which the
   section thereby checks). Engines: vLLM; HF as RL runs it (fp32 policy under bf16 autocast); HF bf16.
4. ``serve``: ``kpipe.llm.vllm_server.VLLMServer`` (``vllm serve``) on the trained nano checkpoint,
   a few completions through ``kpipe.llm.openai_engine.OpenAIEngine``, then ``kpipe.agent.distill.
   distill_shard`` for one task and one turn with that engine and KernelGym's in-process pool.

Section 5 of the issue, RL with ``engine: vllm``, is ``checks.gpu.rl_learns --engine vllm`` (its own
device call: it needs the whole 10 minutes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from checks.gpu.harness import CheckFailed, Report, Section

ROOT = Path(__file__).resolve().parents[2]
TITLE = "vLLM on one GPU: version, throughput vs HF, rollout/trainer mismatch, vllm serve"
POLICIES = ("nano", "qwen3-0.6b")
BATCHES = (16, 64)
MAX_TOKENS = 256
SPEEDUP_TARGET = 5.0
MISMATCH_N = 64
GPU_UTIL = 0.3
FALLBACK_BACKEND = "FLEX_ATTENTION"  # the one vLLM 0.26 backend besides FLASH_ATTN that takes head_size 16
CHILD_TIMEOUT_S = 240
SERVE_TIMEOUT_S = 240
TRAIN_STEPS = 30
QUANTILES = (0.0, 0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99, 1.0)
INSTALL_HINT = ("vLLM is not importable: install vllm 0.26.0 into /tmp/site and export PYTHONPATH=$PWD/src:/tmp/site "
                "PATH=/tmp/site/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0 (docs/vllm-on-the-device.md)")



def sampling_requests(prompts: list[Any], n: int, max_tokens: int, offset: int = 0) -> list[Any]:
    """`n` requests cycling over `prompts`, as RL samples (temperature 1, per-request seeds, log-probs)."""
    from kpipe.llm.types import ChatRequest

    return [ChatRequest(messages=prompts[i % len(prompts)], max_tokens=max_tokens, temperature=1.0,
                        top_p=1.0, seed=offset + i, logprobs=True) for i in range(n)]

def add_options(parser: argparse._ArgumentGroup) -> None:
    parser.add_argument("--cpu", action="store_true", help="refused: vLLM needs a GPU (there is no CPU mode)")
    parser.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated of {POLICIES}")
    parser.add_argument("--gpu-util", type=float, default=GPU_UTIL, help="vLLM gpu_memory_utilization")
    parser.add_argument("--mismatch-n", type=int, default=MISMATCH_N, help="sequences per engine for mismatch")
    parser.add_argument("--keep-work", action="store_true", help="keep the models, logs and samples (path printed)")


# --------------------------------------------------------------------------- pure helpers (unit-tested)


def quantiles(values: list[float], qs: tuple[float, ...] = QUANTILES) -> dict[str, float]:
    """Linear-interpolation quantiles (numpy's default) of `values`, keyed "q0.05"; empty: {}."""
    data = sorted(float(v) for v in values if v is not None and not math.isnan(float(v)))
    if not data:
        return {}
    out = {}
    for q in qs:
        pos = q * (len(data) - 1)
        low = math.floor(pos)
        high = min(low + 1, len(data) - 1)
        out[f"q{q:g}"] = data[low] + (data[high] - data[low]) * (pos - low)
    return out


def tokens_per_s(completion_tokens: list[int], seconds: float) -> float:
    return float(sum(completion_tokens)) / seconds if seconds > 0 else float("nan")


def speedup_verdict(results: dict[str, dict[str, Any]], batch: int = 64,
                    target: float = SPEEDUP_TARGET) -> dict[str, Any]:
    """vLLM over HF tokens/s at `batch` per policy; ok when at least one policy reaches `target`.
    `results[policy]` = {"vllm": {batch: tok/s}, "hf": {batch: tok/s}} (batch keys int or str)."""
    ratios = {}
    for policy, engines in results.items():
        v = (engines.get("vllm") or {}).get(batch, (engines.get("vllm") or {}).get(str(batch)))
        h = (engines.get("hf") or {}).get(batch, (engines.get("hf") or {}).get(str(batch)))
        if v and h and h > 0 and not math.isnan(v) and not math.isnan(h):
            ratios[policy] = v / h
    ok = any(r >= target for r in ratios.values())
    return {"batch": batch, "target": target, "ratios": ratios, "ok": ok}


_BACKEND = re.compile(r"Using (\w+) (?:attention )?backend")
_FA_VERSION = re.compile(r"Using FlashAttention version (\d)")
_VERSION = re.compile(r"vLLM API server version ([\w.+-]+)")


def parse_vllm_log(text: str) -> dict[str, Any]:
    """What vLLM logged about its choices: attention backend(s), FlashAttention version, compile and
    CUDA-graph seconds (vLLM 0.26 log lines), and lines with errors."""
    backends = [b for b in _BACKEND.findall(text) if b.upper() == b or "_" in b]
    fa = _FA_VERSION.findall(text)
    found: dict[str, Any] = {"attention_backends": sorted(set(backends)),
                             "flash_attn_version": int(fa[-1]) if fa else None}
    compile_s = re.findall(r"torch\.compile takes ([\d.]+) s in total", text)
    graphs = re.findall(r"Graph capturing finished in ([\d.]+) secs", text)
    init = re.findall(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s", text)
    if compile_s:
        found["torch_compile_s"] = float(compile_s[-1])
    if graphs:
        found["cuda_graph_capture_s"] = float(graphs[-1])
    if init:
        found["init_engine_s"] = float(init[-1])
    version = _VERSION.findall(text)
    if version:
        found["server_version"] = version[-1]
    found["error_lines"] = [line.strip()[:300] for line in text.splitlines()
                            if re.search(r"\b(Error|ERROR|Traceback)\b", line)][:10]
    return found


def mismatch_stats(log_w: list[float], keep: list[bool], has_tokens: list[bool], train_nll: float,
                   rollout_nll: float, tokens: float, token_log_ratios: list[float]) -> dict[str, Any]:
    """The numbers the mismatch section reports for one engine: w = exp(log w) quantiles over the
    sequences with tokens, |log w| mean, MRS rejections, token log-ratio quantiles, perplexities."""
    rows = [lw for lw, has in zip(log_w, has_tokens, strict=True) if has]
    w = [math.exp(x) for x in rows]
    kept = sum(1 for k, has in zip(keep, has_tokens, strict=True) if k and has)
    return {"sequences": len(rows), "tokens": int(tokens),
            "w": quantiles(w), "abs_log_w_mean": (sum(abs(x) for x in rows) / len(rows)) if rows else float("nan"),
            "mrs_kept": kept, "mrs_rejected": len(rows) - kept,
            "token_log_ratio": quantiles(token_log_ratios, (0.0, 0.001, 0.01, 0.5, 0.99, 0.999, 1.0)),
            "rollout_ppl": math.exp(rollout_nll / tokens) if tokens else float("nan"),
            "train_ppl": math.exp(train_nll / tokens) if tokens else float("nan")}


def fmt(value: Any, digits: int = 4) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.{digits}g}"
    return str(value)


# --------------------------------------------------------------------------- shared state


class State:
    """What the sections share in one process: the work folder, the policies, each child's result."""

    def __init__(self) -> None:
        self.work: Path | None = None
        self.paths: dict[str, Path] = {}
        self.children: dict[str, dict[str, Any]] = {}
        self.hf: dict[str, dict[str, Any]] = {}
        self.prompts: list[list[dict[str, str]]] | None = None
        self.errors: dict[str, str] = {}

    def folder(self, args: argparse.Namespace) -> Path:
        if self.work is None:
            self.work = Path(tempfile.mkdtemp(prefix="kpipe-vllm-check-"))
            print(f"work folder {self.work}", flush=True)
            if not args.keep_work:
                import atexit

                atexit.register(shutil.rmtree, self.work, True)
        return self.work


STATE = State()


def require_gpu(report: Report, args: argparse.Namespace) -> None:
    if args.cpu or report.facts.get("device") == "cpu":
        raise CheckFailed("vLLM needs a GPU: this check has no CPU mode (run it on the GPU device)")
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise CheckFailed(INSTALL_HINT)
    if os.environ.get("VLLM_USE_FLASHINFER_SAMPLER") != "0":
        os.environ["VLLM_USE_FLASHINFER_SAMPLER"] = "0"  # FlashInfer is not installed (the doc's one variable)
        print("VLLM_USE_FLASHINFER_SAMPLER was not 0: set to 0 for this check and its children", flush=True)


def chosen_policies(args: argparse.Namespace) -> list[str]:
    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in names if p not in POLICIES]
    if unknown:
        raise CheckFailed(f"unknown policies {unknown}; choose from {POLICIES}")
    return names


def bank_prompts() -> list[list[dict[str, str]]]:
    """The first-turn messages of every bank task (its KernelBench `main` reference), in bank order."""
    if STATE.prompts is None:
        from kpipe.data.kernelbench import load_problems
        from kpipe.gym.bank import list_solutions
        from kpipe.llm.prompts import first_turn_messages

        problems = {(p.level, p.problem_id): p for p in load_problems("main")}
        keys = sorted({(s.level, s.problem_id) for s in list_solutions("legit")})
        STATE.prompts = [first_turn_messages(problems[k].code) for k in keys if k in problems]
    return STATE.prompts


def legit_texts() -> list[tuple[list[dict[str, str]], str]]:
    """(first-turn messages, legit kernel in a fenced block) per bank task: the quick training set."""
    from kpipe.data.kernelbench import load_problems
    from kpipe.gym.bank import list_solutions
    from kpipe.llm.prompts import first_turn_messages

    problems = {(p.level, p.problem_id): p for p in load_problems("main")}
    out = []
    for s in list_solutions("legit"):
        if (s.level, s.problem_id) in problems:
            out.append((first_turn_messages(problems[(s.level, s.problem_id)].code), f"```python\n{s.source}\n```"))
    return out


def policy_path(name: str, args: argparse.Namespace) -> Path:
    """The saved policy `name` ("nano", "nano-trained", "qwen3-0.6b"), built on first use."""
    if name in STATE.paths:
        return STATE.paths[name]
    work = STATE.folder(args)
    started = time.monotonic()
    if name == "nano":
        from kpipe.train.tiny_model import tiny_model_job

        path = tiny_model_job(work / "nano", size="nano", seed=0, tokenizer="bpe", vocab_size=4000)
    elif name == "qwen3-0.6b":
        path = build_06b(policy_path("nano", args), work / "qwen3-0.6b")
    elif name == "nano-trained":
        path = train_nano(policy_path("nano", args), work / "nano-trained")
    else:
        raise ValueError(name)
    print(f"policy {name}: {path} in {time.monotonic() - started:.1f} s", flush=True)
    STATE.paths[name] = path
    return path


def build_06b(nano: Path, out: Path) -> Path:
    """The qwen3-0.6b preset of kpipe's tiny-model builder, random weights, the nano BPE tokenizer
    (one embedding row per token), saved as a HF checkpoint with that tokenizer."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen3ForCausalLM

    from kpipe.train.tiny_model import tiny_config

    tokenizer = AutoTokenizer.from_pretrained(nano, local_files_only=True)
    config = tiny_config("qwen3-0.6b", len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id, exact_vocab=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id, do_sample=True)
    model.save_pretrained(out)
    for item in nano.iterdir():  # the tokenizer files, as build_tiny_model writes them
        if "token" in item.name or item.name.endswith((".jinja", "special_tokens_map.json")):
            shutil.copy2(item, out / item.name)
    print(f"qwen3-0.6b: {model.num_parameters() / 1e6:.0f} M parameters", flush=True)
    return out


def train_nano(nano: Path, out: Path, steps: int = TRAIN_STEPS) -> Path:
    """`steps` AdamW steps (lr 1e-2, bf16 autocast over fp32 weights) of the nano policy on every bank
    task's first-turn prompt + legit kernel (the whole text), saved like the SFT model (fp32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kpipe.train.rl_update import prompt_text

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(nano, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(nano, dtype=torch.float32, local_files_only=True).to(device)
    texts = [prompt_text(tokenizer, messages) + answer + "<|im_end|>" for messages, answer in legit_texts()]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    losses = []
    for _ in range(steps):
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    print(f"nano-trained: {steps} steps on {len(texts)} texts, loss {losses[0]:.3f} -> {losses[-1]:.3f}", flush=True)
    STATE.hf["train_losses"] = {"first": losses[0], "last": losses[-1], "steps": steps, "texts": len(texts)}
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    from kpipe.train.tiny_model import _portable_tokenizer_class

    _portable_tokenizer_class(out / "tokenizer_config.json")
    del model, optimizer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


# --------------------------------------------------------------------------- the vLLM children


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)  # another check's module sets it on import; vLLM runs without
    env.update(VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONUNBUFFERED="1")
    src = str(ROOT / "src")
    if src not in env.get("PYTHONPATH", "").split(os.pathsep):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, str(ROOT), env.get("PYTHONPATH")]))
    elif str(ROOT) not in env["PYTHONPATH"].split(os.pathsep):
        env["PYTHONPATH"] = env["PYTHONPATH"] + os.pathsep + str(ROOT)
    return env


def run_child(policy: str, args: argparse.Namespace, backend: str | None = None) -> dict[str, Any]:
    """One vLLM engine in a child process: start-up, warm-up, throughput, mismatch samples (nano:
    also after pushing the trained weights). Returns its result JSON plus what its log says."""
    work = STATE.folder(args)
    tag = policy + (f"-{backend}" if backend else "")
    spec = {"model": str(policy_path(policy, args)), "policy": policy, "backend": backend,
            "gpu_util": args.gpu_util, "batches": list(BATCHES), "max_tokens": MAX_TOKENS,
            "prompts": bank_prompts(), "mismatch_n": args.mismatch_n,
            "push_from": str(policy_path("nano-trained", args)) if policy == "nano" else None,
            "out": str(work / f"child-{tag}.json")}
    spec_path = work / f"child-{tag}.spec.json"
    spec_path.write_text(json.dumps(spec))
    log_path = work / f"child-{tag}.log"
    started = time.monotonic()
    with open(log_path, "w") as log:
        try:
            done = subprocess.run([sys.executable, "-m", "checks.gpu.vllm", "CHILD", str(spec_path)], cwd=ROOT,
                                  env=child_env(), stdout=log, stderr=subprocess.STDOUT, timeout=CHILD_TIMEOUT_S)
            code: int | str = done.returncode
        except subprocess.TimeoutExpired:
            code = f"timeout after {CHILD_TIMEOUT_S} s"
    text = log_path.read_text(errors="replace")
    result = json.loads(Path(spec["out"]).read_text()) if Path(spec["out"]).exists() else {}
    result.update(exit=code, wall_s=time.monotonic() - started, log=parse_vllm_log(text), backend_forced=backend,
                  log_tail=text[-2500:] if code != 0 else "")
    if args.keep_work:
        print(f"child log {log_path}", flush=True)
    if code != 0:
        print(f"--- child {tag} exited {code}; its log's end:\n{text[-4000:]}", flush=True)
    return result


def child_result(policy: str, args: argparse.Namespace) -> dict[str, Any]:
    """The policy's child result, run on first use; the nano policy falls back to FLEX_ATTENTION when
    its engine did not start with vLLM's own choice."""
    if policy not in STATE.children:
        result = run_child(policy, args)
        if "startup_s" not in result and policy == "nano":
            first = result
            result = run_child(policy, args, FALLBACK_BACKEND)
            result["first_attempt"] = {k: first.get(k) for k in ("exit", "error", "log", "log_tail")}
        STATE.children[policy] = result
    return STATE.children[policy]


def child_main(spec_path: str) -> int:
    """In the child: one VLLMEngine as kpipe's RL builds it; writes its result after every stage."""
    spec = json.loads(Path(spec_path).read_text())
    out: dict[str, Any] = {"policy": spec["policy"]}
    save = lambda: Path(spec["out"]).write_text(json.dumps(out, default=str))  # noqa: E731
    try:
        started = time.monotonic()
        import torch
        import vllm

        from kpipe.llm.vllm_engine import VLLMEngine
        from kpipe.train.rl_config import RLConfig
        from kpipe.train.rollouts import vllm_engine_args

        out.update(vllm=vllm.__version__, torch=torch.__version__, gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                   import_s=time.monotonic() - started)
        cfg = RLConfig(engine="vllm", max_tokens=spec["max_tokens"], vllm_gpu_memory_utilization=spec["gpu_util"])
        llm_args = vllm_engine_args(cfg, 1)
        if spec["backend"]:
            llm_args["attention_backend"] = spec["backend"]
        out["llm_args"] = llm_args
        save()
        started = time.monotonic()
        engine = VLLMEngine(spec["model"], name=spec["policy"], seed=0, **llm_args)
        out["startup_s"] = time.monotonic() - started
        out["runner"] = describe_runner(engine)
        save()
        prompts = spec["prompts"]

        started = time.monotonic()
        engine.generate(sampling_requests(prompts, 8, 16, 10_000))
        out["warmup_s"] = time.monotonic() - started
        out["throughput"] = {}
        for batch in spec["batches"]:
            sync()
            started = time.perf_counter()
            done = engine.generate(sampling_requests(prompts, batch, spec["max_tokens"]))
            seconds = time.perf_counter() - started
            counts = [c.completion_tokens for c in done]
            out["throughput"][str(batch)] = {"seconds": seconds, "tokens": sum(counts),
                                             "tokens_per_s": tokens_per_s(counts, seconds),
                                             "finish": {r: sum(c.finish_reason == r for c in done) for r in
                                                        {c.finish_reason for c in done}}}
            if batch == max(spec["batches"]):
                out["samples_random"] = samples(done, sampling_requests(prompts, batch, spec["max_tokens"]), prompts)
            save()
        if spec.get("push_from"):
            from kpipe.train.rl import load_policy
            from kpipe.train.rollouts import push_weights_to_vllm

            model = load_policy(Path(spec["push_from"]), cfg)[0].to("cuda" if torch.cuda.is_available() else "cpu")
            started = time.monotonic()
            push_weights_to_vllm(engine, model)
            sync()
            out["push_s"] = time.monotonic() - started
            out["pushed_tensors"] = len(model.state_dict())
            del model
            sync()
            asked = sampling_requests(prompts, spec["mismatch_n"], spec["max_tokens"], 20_000)
            started = time.perf_counter()
            done = engine.generate(asked)
            out["trained_generate_s"] = time.perf_counter() - started
            out["samples_trained"] = samples(done, asked, prompts)
            save()
        out["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        traceback.print_exc()
        out["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        save()
        return 1
    save()
    return 0


def describe_runner(engine: Any) -> dict[str, Any]:
    """The worker's model runner and attention backend classes (in-process engine), best effort."""
    def look(worker: Any) -> dict[str, Any]:
        runner = worker.model_runner
        found: dict[str, Any] = {"model_runner": f"{type(runner).__module__}.{type(runner).__name__}",
                                 "model": type(runner.get_model()).__name__}
        backends = set()
        for attr in ("attn_groups", "attn_backends"):
            groups = getattr(runner, attr, None)
            for item in (groups if isinstance(groups, (list, tuple)) else [groups] if groups else []):
                for sub in (item if isinstance(item, (list, tuple)) else [item]):
                    backend = getattr(sub, "backend", sub)
                    backends.add(getattr(backend, "__name__", type(backend).__name__))
        found["attention"] = sorted(backends)
        return found

    try:
        return engine.llm.collective_rpc(look)[0]
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"}


def samples(done: list[Any], asked: list[Any], prompts: list[Any]) -> list[dict[str, Any]]:
    return [{"prompt_index": i % len(prompts), "token_ids": c.token_ids, "logprobs": c.logprobs,
             "finish_reason": c.finish_reason} for i, (c, _) in enumerate(zip(done, asked, strict=True))]


# --------------------------------------------------------------------------- HF side


def sync() -> None:
    """Wait for the GPU and hand its cached blocks back (nothing on a CPU)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def hf_throughput(policy: str, args: argparse.Namespace) -> dict[str, Any]:
    """HFEngine (bf16 weights) tokens/s at each batch size, after a warm-up; and its batch-64 samples."""
    if policy in STATE.hf:
        return STATE.hf[policy]
    from kpipe.llm.hf_engine import HFEngine

    prompts = bank_prompts()
    result: dict[str, Any] = {"throughput": {}}
    STATE.hf[policy] = result
    started = time.monotonic()
    engine = HFEngine.from_pretrained(str(policy_path(policy, args)), device=None, dtype="bfloat16",
                                      batch_size=max(BATCHES), seed=0, progress=False)
    result["load_s"] = time.monotonic() - started
    try:
        started = time.monotonic()
        engine.generate(sampling_requests(prompts, 8, 16, 10_000))
        result["warmup_s"] = time.monotonic() - started
        for batch in BATCHES:
            engine.batch_size = batch
            sync()
            started = time.perf_counter()
            done = engine.generate(sampling_requests(prompts, batch, MAX_TOKENS))
            sync()
            seconds = time.perf_counter() - started
            counts = [c.completion_tokens for c in done]
            result["throughput"][str(batch)] = {"seconds": seconds, "tokens": sum(counts),
                                                "tokens_per_s": tokens_per_s(counts, seconds)}
            if batch == max(BATCHES) and policy == "nano":
                result["samples_random"] = samples(done, sampling_requests(prompts, batch, MAX_TOKENS), prompts)
    finally:
        del engine
        sync()
    return result


def hf_rl_samples(path: Path, n: int) -> list[dict[str, Any]]:
    """HF generation as kpipe's RL runs it with engine hf on one process: the fp32 policy (load_policy)
    on the GPU, HFEngine over it, under Accelerator(mixed_precision="bf16").autocast()."""
    import torch
    from accelerate import Accelerator

    from kpipe.llm.hf_engine import HFEngine
    from kpipe.llm.types import ChatRequest
    from kpipe.train.rl import load_policy
    from kpipe.train.rl_config import RLConfig

    prompts = bank_prompts()
    model, tokenizer = load_policy(path, RLConfig())
    model = model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
    engine = HFEngine(model, tokenizer, name="hf-rl", batch_size=n, seed=0, progress=False)
    asked = [ChatRequest(messages=prompts[i % len(prompts)], max_tokens=MAX_TOKENS, temperature=1.0, top_p=1.0,
                         seed=30_000 + i, logprobs=True) for i in range(n)]
    with Accelerator(mixed_precision="bf16").autocast():
        done = engine.generate(asked)
    del engine, model
    sync()
    return samples(done, asked, prompts)


def trainer_mismatch(path: Path, sampled: list[dict[str, Any]]) -> dict[str, Any]:
    """The trainer's log-probs of `sampled` (kpipe's RL: load_policy, policy_log_probs under bf16
    autocast), then mismatch_keep, token_totals and the statistics."""
    import torch
    from accelerate import Accelerator

    from kpipe.train.rl import load_policy
    from kpipe.train.rl_batch import mismatch_keep
    from kpipe.train.rl_config import RLConfig
    from kpipe.train.rl_update import policy_log_probs, token_samples, token_totals

    cfg = RLConfig()
    prompts = bank_prompts()
    accelerator = Accelerator(mixed_precision="bf16")
    model, tokenizer = load_policy(path, cfg)
    model = model.to(accelerator.device).eval()
    rows = [{"prompt_messages": prompts[s["prompt_index"]], "response_token_ids": s["token_ids"]} for s in sampled]
    token_rows = token_samples(rows, tokenizer)
    with torch.no_grad(), accelerator.autocast():
        train_logp = policy_log_probs(model, token_rows, cfg.temperature, cfg.micro_batch_tokens,
                                      tokenizer.pad_token_id, accelerator.device)
    rollout_logp = [list(s["logprobs"] or []) for s in sampled]
    for s, t, r in zip(sampled, train_logp, rollout_logp, strict=True):
        if len(t) != len(r):
            raise CheckFailed(f"{len(r)} rollout log-probs for {len(s['token_ids'])} tokens ({len(t)} trainer)")
    keep, log_w = mismatch_keep(train_logp, rollout_logp, cfg)
    has_tokens = [len(t) > 0 for t in train_logp]
    totals = token_totals([t for t, h in zip(train_logp, has_tokens) if h],
                          [r for r, h in zip(rollout_logp, has_tokens) if h])
    token_ratios = [float(a) - b for t, r in zip(train_logp, rollout_logp) for a, b in zip(t.tolist(), r)]
    del model
    sync()
    stats = mismatch_stats(log_w.tolist(), keep.tolist(), has_tokens, totals["train_nll"][0],
                           totals["rollout_nll"][0], totals["train_nll"][1], token_ratios)
    stats.update(mrs_delta=cfg.mrs_delta, mrs_token_veto=cfg.mrs_token_veto)
    return stats


# --------------------------------------------------------------------------- sections


def version(report: Report, args: argparse.Namespace) -> None:
    """vLLM and torch versions, GPU, and for each policy the engine's attention backend and start-up."""
    require_gpu(report, args)
    report.data["python"] = sys.version.split()[0]
    report.table("policy", "vLLM", "torch", "GPU", "attention backend (log)", "FA version", "model runner / "
                 "attention classes", "import s", "engine start-up s", "torch.compile s", "CUDA graphs s", "status")
    for policy in chosen_policies(args):
        def one(policy: str = policy) -> tuple[bool, list[Any]]:
            r = child_result(policy, args)
            report.data[policy] = {k: v for k, v in r.items() if not k.startswith("samples_")}
            log = r.get("log", {})
            runner = r.get("runner", {})
            status = "ok" if "startup_s" in r else f"FAILED: {r.get('error') or r.get('exit')}"
            if r.get("backend_forced"):
                status += f" (forced {r['backend_forced']}; default failed: {(r.get('first_attempt') or {}).get('error')})"
            return "startup_s" in r, [r.get("vllm", "?"), r.get("torch", "?"), r.get("gpu", "?"),
                                      ",".join(log.get("attention_backends", [])) or "?",
                                      log.get("flash_attn_version"),
                                      f"{runner.get('model_runner', '?')}; {runner.get('attention', runner.get('error'))}",
                                      fmt(r.get("import_s", float("nan")), 3), fmt(r.get("startup_s", float("nan")), 3),
                                      log.get("torch_compile_s", "?"), log.get("cuda_graph_capture_s", "?"), status]
        report.item(policy, 12, one)
    report.line("", "Start-up is `LLM(...)` from empty compile caches (the harness's fresh Triton and Inductor "
                "cache folders; vLLM's own cache under ~/.cache/vllm is empty on a fresh machine): "
                "loading the checkpoint, Dynamo tracing and Inductor compiling the model's pieces between attention "
                "calls (Triton kernels), the memory profile run, KV-cache allocation and CUDA-graph capture.")
    for policy in chosen_policies(args):
        tail = STATE.children.get(policy, {}).get("log_tail")
        if tail:
            report.line("", f"{policy} child's log (end):", "", "```", *tail.splitlines()[-25:], "```")


def throughput(report: Report, args: argparse.Namespace) -> None:
    """vLLM vs HF tokens/s on the same prompts, batch 16 and 64; 5x at batch 64 for one policy."""
    require_gpu(report, args)
    table: dict[str, dict[str, Any]] = {}
    report.table("policy", "engine", "batch", "tokens", "seconds", "tokens/s", "start-up / load s", "warm-up s")
    for policy in chosen_policies(args):
        table[policy] = {"vllm": {}, "hf": {}}

        def rows(engine: str, policy: str = policy) -> tuple[bool, list[Any]]:
            r = child_result(policy, args) if engine == "vllm" else hf_throughput(policy, args)
            if not r.get("throughput"):
                raise RuntimeError(r.get("error") or f"no throughput measured (exit {r.get('exit')})")
            label = "vLLM" if engine == "vllm" else "HF (bf16)"
            start = r.get("startup_s", r.get("load_s", float("nan")))
            cells = []
            for batch, t in r["throughput"].items():
                table[policy][engine][int(batch)] = t["tokens_per_s"]
                cells.append([label, batch, t["tokens"], fmt(t["seconds"]), fmt(t["tokens_per_s"]), fmt(start),
                              fmt(r.get("warmup_s", float("nan")))])
            for line in cells[:-1]:
                report.row(policy, *line)
            return True, cells[-1]

        report.item(policy, 8, lambda policy=policy: rows("vllm", policy))
        report.item(policy, 8, lambda policy=policy: rows("hf", policy))
    verdict = speedup_verdict(table)
    report.data.update(tokens_per_s=table, verdict=verdict)
    report.line("", "vLLM / HF tokens/s at batch 64: " + (", ".join(f"{p} {r:.2f}x" for p, r in
                                                                     verdict["ratios"].items()) or "none measured")
                + f" (target {SPEEDUP_TARGET:g}x for at least one policy). Tokens counted up to and including EOS; "
                "both engines sample with per-request seeds and return the sampled tokens' log-probs, as RL asks.")
    report.expect(verdict["ok"], f"vLLM below {SPEEDUP_TARGET:g}x HF tokens/s at batch 64 for every policy")


def mismatch(report: Report, args: argparse.Namespace) -> None:
    """Trainer vs rollout log-probs per sequence: ratio quantiles, MRS rejections, perplexities."""
    require_gpu(report, args)
    nano, trained = policy_path("nano", args), policy_path("nano-trained", args)
    if "train_losses" in STATE.hf:
        report.data["training"] = STATE.hf["train_losses"]
    sets: list[tuple[str, str, Path, Any]] = [
        ("vLLM", "random", nano, lambda: child_result("nano", args).get("samples_random")),
        ("vLLM (weights pushed)", "trained", trained, lambda: child_result("nano", args).get("samples_trained")),
        ("HF as RL (fp32 policy, bf16 autocast)", "random", nano, lambda: hf_rl_samples(nano, args.mismatch_n)),
        ("HF as RL (fp32 policy, bf16 autocast)", "trained", trained, lambda: hf_rl_samples(trained, args.mismatch_n)),
        ("HF bf16 weights", "random", nano, lambda: hf_throughput("nano", args).get("samples_random")),
    ]
    report.table("engine", "policy", "sequences", "tokens", "w q0.01 / q0.5 / q0.99", "w min / max",
                 "mean abs log w", "MRS rejects", "token log-ratio q0.001 / q0.999", "rollout ppl", "trainer ppl")
    results: dict[str, Any] = {}
    for engine, policy, path, sampled in sets:
        def one(engine: str = engine, policy: str = policy, path: Path = path, sampled: Any = sampled
                ) -> tuple[bool, list[Any]]:
            drawn = sampled()
            if not drawn:
                child = STATE.children.get("nano", {})
                raise RuntimeError(f"no samples ({child.get('error') or 'the engine did not produce them'})")
            s = trainer_mismatch(path, drawn[: args.mismatch_n])
            results[f"{engine} | {policy}"] = s
            w, t = s["w"], s["token_log_ratio"]
            ok = True
            if "pushed" in engine:  # the push worked iff vLLM now samples from the trained weights
                ok = report.expect(s["abs_log_w_mean"] < 0.5, "push_weights_to_vllm: vLLM's log-probs are not the "
                                   f"trained policy's (mean |log w| {s['abs_log_w_mean']:.3g})")
            return ok, [policy, s["sequences"], s["tokens"],
                        " / ".join(fmt(w.get(q, float("nan"))) for q in ("q0.01", "q0.5", "q0.99")),
                        f"{fmt(w.get('q0', float('nan')))} / {fmt(w.get('q1', float('nan')))}",
                        fmt(s["abs_log_w_mean"]), f"{s['mrs_rejected']}/{s['sequences']}",
                        f"{fmt(t.get('q0.001', float('nan')))} / {fmt(t.get('q0.999', float('nan')))}",
                        fmt(s["rollout_ppl"]), fmt(s["train_ppl"])]
        report.item(engine, 11, one)
    report.data["engines"] = results
    child = STATE.children.get("nano", {})
    report.line("", "Policies: `random` is the nano policy as built (random weights); `trained` the same after "
                f"{TRAIN_STEPS} AdamW steps on the bank's legit kernels"
                + (f" (loss {STATE.hf['train_losses']['first']:.2f} -> {STATE.hf['train_losses']['last']:.2f})"
                   if "train_losses" in STATE.hf else "")
                + f"; vLLM got the trained weights by `push_weights_to_vllm` into its running engine "
                  f"({fmt(child.get('push_s', float('nan')))} s, {child.get('pushed_tensors', '?')} tensors). "
                  "MRS (Eq. 6, kpipe's `mismatch_keep`) keeps a sequence iff w is in [0.999, 1.001] and no token "
                  "ratio is below 1e-4. Perplexities: exp of the mean negative log-prob of the same tokens under "
                  "the rollout engine and under the trainer (Figure 7).")


def serve(report: Report, args: argparse.Namespace) -> None:
    """`vllm serve` of the trained nano checkpoint, completions through the OpenAI engine, and one
    distillation turn of one task through it, judged by KernelGym in process."""
    require_gpu(report, args)
    from kpipe.llm.types import ChatRequest

    try:
        from kpipe.llm.openai_engine import OpenAIEngine
        from kpipe.llm.vllm_server import VLLMServer, VLLMServerConfig
    except ImportError as exc:
        raise CheckFailed(f"kpipe's OpenAI engine cannot import ({exc}): openai comes with vLLM's wheels") from exc
    sync()
    work = STATE.folder(args)
    model = policy_path("nano-trained", args)
    config = VLLMServerConfig(model=str(model), served_model_name="nano", max_model_len=16384,
                              gpu_memory_utilization=args.gpu_util)
    log_path = work / "vllm-serve.log"
    os.environ.update(VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1")
    server = VLLMServer(config, log_path=log_path, startup_timeout_s=SERVE_TIMEOUT_S)
    report.data["serve_args"] = server.config.__dict__ | {"port": server.port}
    started = time.monotonic()
    try:
        server.start()
    except Exception as exc:
        text = log_path.read_text(errors="replace") if log_path.exists() else ""
        report.data["log"] = parse_vllm_log(text)
        report.line("`vllm serve` log (end):", "", "```", *text[-3000:].splitlines()[-30:], "```")
        raise CheckFailed(f"vllm serve did not start: {str(exc).splitlines()[0]}") from exc
    try:
        startup = time.monotonic() - started
        text = log_path.read_text(errors="replace")
        report.data.update(startup_s=startup, log=parse_vllm_log(text))
        report.line(f"`vllm serve {model.name}` answered /health after {startup:.1f} s "
                    f"(backend {','.join(report.data['log'].get('attention_backends', [])) or '?'}).")
        engine = OpenAIEngine(server.openai_config(concurrency=16, progress=False, max_retries=1, timeout_s=120))
        prompts = bank_prompts()
        asked = [ChatRequest(messages=prompts[i], max_tokens=64, temperature=1.0, seed=i) for i in range(4)]
        started = time.monotonic()
        done = engine.generate(asked)
        report.data["completions"] = [c.to_json() for c in done]
        report.table("request", "finish", "prompt tokens", "completion tokens", "text (start)")
        for i, c in enumerate(done):
            report.row(f"bank prompt {i}", c.finish_reason, c.prompt_tokens, c.completion_tokens,
                       repr(c.text[:80]), ok=not c.failed)
        report.line("", f"{len(done)} completions in {time.monotonic() - started:.1f} s.")
        report.item("distill (1 task, 1 turn)", 2, lambda: distill_once(engine, work, report))
    finally:
        server.stop()


def distill_once(engine: Any, work: Path, report: Report) -> tuple[bool, list[Any]]:
    """kpipe.agent.distill.distill_shard, one task x one turn x 2 samples, the OpenAI engine on the
    vLLM server as the teacher, KernelGym's pool (one worker on this GPU) as the judge."""
    from kpipe.agent.distill import distill_shard
    from kpipe.agent.evaluator import open_evaluator
    from kpipe.agent.loop import AgentTask, Sampling
    from kpipe.data.io import read_table
    from kpipe.data.kernelbench import load_problems
    from kpipe.gym import Protocol

    problem = {(p.level, p.problem_id): p for p in load_problems("main")}[(1, 19)]
    task = AgentTask("kb-main-L1-19", problem.code)
    protocol = Protocol.from_dict({"baseline": "eager"})
    started = time.monotonic()
    with open_evaluator({"backend": "pool", "workers": 1, "protocol": protocol.to_dict()}, reuse_reference=True,
                        progress=False) as pool:
        summaries = distill_shard([task], engine, pool, work / "distill.parquet", work / "distill-cache.sqlite",
                                  run="vllm-check", n_turns=1, n_samples=2,
                                  sampling=Sampling(max_tokens=MAX_TOKENS, temperature=1.0),
                                  eval_namespace=protocol.to_json(), progress=False)
    rows = read_table(work / "distill.parquet", "trajectories").to_pylist()
    keep = ("task_id", "sample", "turn", "status", "correct", "hacked", "speedup_eager", "reward", "model")
    report.data["distill"] = {"seconds": time.monotonic() - started, "rows": [{k: r.get(k) for k in keep}
                                                                              for r in rows],
                              "summaries": [getattr(s, "__dict__", str(s)) for s in summaries],
                              "answers": [str(r.get("response") or r.get("completion") or "")[:400] for r in rows]}
    statuses = ", ".join(f"{r.get('status')}" for r in rows)
    return len(rows) == 2, [f"{len(rows)} rows in {time.monotonic() - started:.0f} s; statuses {statuses}"]


SECTIONS = (
    Section("version", 230, version),  # policies ~40 s, nano engine ~100 s, 0.6B engine ~90 s
    Section("throughput", 50, throughput),  # the vLLM numbers come from version's engines; HF ~40 s
    Section("mismatch", 35, mismatch),
    Section("serve", 150, serve),  # vllm serve start-up ~80 s, KernelGym pool + one distillation turn
)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "CHILD":
        code = child_main(sys.argv[2])
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # vLLM's in-process engine may hang in interpreter shutdown; the result is written
    sys.exit("run this check as `python3 -m checks.gpu vllm` (this module's own entry point is for its children)")


def figures(report: dict[str, Any]) -> dict[str, Any]:
    """The ledger's figures: vLLM's tokens/s over HF's at batch 64 per policy, and `vllm serve`'s start."""
    data = {name: section["data"] for name, section in report["sections"].items()}
    ratios = data.get("throughput", {}).get("verdict", {}).get("ratios", {})
    serve = data.get("serve", {})
    return {**{f"vllm_over_hf_{policy}": round(ratio, 2) for policy, ratio in ratios.items()},
            **({"serve_start_s": round(serve["startup_s"], 1)} if "startup_s" in serve else {})}
