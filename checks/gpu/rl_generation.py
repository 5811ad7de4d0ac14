"""Why an RL step's generation takes 10-13 s inside the DAG's RL jobs on an H200 and 1.3 s in a fresh
process (`965801b:docs/gpu-results/dag_2026-11-26_H200.md`): the same generate() call, one difference at a
time, each in a fresh process on the nano policy (random weights, the DAG's BPE tokenizer).

    python3 -m checks.gpu rl_generation          # ~2 minutes on one H100

Found (first run, 3978b7f, H200): torch 2.11 picks cuDNN's attention on Hopper, which builds a graph for
every new key length, so every decode step: 23.7 ms of host time per call, 12 of the 15 s. Since then
`kpipe.llm.hf_engine` decodes with every SDPA backend but cuDNN's (`DECODE_ATTENTION`); the first
variant puts cuDNN's back first, as it was.

Variants (64 requests of at most 256 tokens, as `config/gpu.yaml`'s RL step):
- `cuDNN attention allowed`: an RL job's call as it was before `DECODE_ATTENTION`;
- `engine`: `HFEngine.from_pretrained` in bf16, no log-probs, no early hand-over (the DAG check's probe);
- `policy`: the policy as an RL job holds it (`load_policy`: fp32 weights,
  `Accelerator(mixed_precision="bf16").prepare`, `unwrap_model`), the rest as `engine`;
- `policy+logprobs`: with the sampled tokens' log-probabilities (MRS needs them);
- `policy+logprobs+early`: and each row handed over at its EOS (`on_result`, the agent loop's path):
  what an RL job runs;
- the last one beside a CPU load (one busy process per core), and beside another process's small
  CUDA kernels on the same GPU (another GPU job of the DAG: contexts of different processes are
  time-sliced);
- the RL job's call under `torch.profiler`: the top operators by CPU time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from checks.gpu.harness import ROOT, CheckFailed, Report, Section

TITLE = "RL step generation: which part of an RL job's generate() costs the time"

REQUESTS, MAX_TOKENS = 64, 256

# One variant in a fresh process: prints one JSON line {load_s, generate_s, tokens}.
VARIANT = r"""
import json, sys, time
started = time.monotonic()
import torch
model_dir, policy, logprobs, early, profile = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1", sys.argv[4] == "1", sys.argv[5] == "1"
import kpipe.llm.hf_engine
from kpipe.llm.hf_engine import HFEngine
if sys.argv[8] == "1":  # torch's own choice, cuDNN's attention first on Hopper (kpipe before DECODE_ATTENTION)
    from torch.nn.attention import SDPBackend
    kpipe.llm.hf_engine.DECODE_ATTENTION = [SDPBackend.CUDNN_ATTENTION, *kpipe.llm.hf_engine.DECODE_ATTENTION]
from kpipe.llm.prompts import first_turn_messages
from kpipe.llm.types import ChatRequest
cuda = torch.cuda.is_available()
sync = torch.cuda.synchronize if cuda else (lambda: None)
if policy:
    from pathlib import Path
    from accelerate import Accelerator
    from kpipe.train.rl import load_policy
    from kpipe.train.rl_config import RLConfig
    accelerator = Accelerator(mixed_precision="bf16" if cuda else "no")
    model, tokenizer = load_policy(Path(model_dir), RLConfig())
    model = accelerator.prepare(model)
    engine = HFEngine(accelerator.unwrap_model(model).eval(), tokenizer, name="policy", batch_size=64, progress=False)
else:
    engine = HFEngine.from_pretrained(model_dir, dtype=torch.bfloat16 if cuda else torch.float32, batch_size=64, progress=False)
from pathlib import Path
bank = sorted(Path("src/kpipe/gym/bank").glob("*/legit.py"))[:4]
prompts = [first_turn_messages(path.read_text()) for path in bank]
def requests(n, max_tokens):
    return [ChatRequest(messages=prompts[i % len(prompts)], max_tokens=max_tokens, temperature=1.0, seed=i,
                        logprobs=logprobs) for i in range(n)]
handed = []
on_result = (lambda index, completion: handed.append(index)) if early else None
engine.generate(requests(8, 8), on_result=on_result)  # warm-up: kernels loaded, allocator primed
sync()
load_s = time.monotonic() - started
def timed():
    begun = time.monotonic()
    out = engine.generate(requests(int(sys.argv[6]), int(sys.argv[7])), on_result=on_result)
    sync()
    return time.monotonic() - begun, sum(c.completion_tokens for c in out)
if profile:
    from torch.profiler import ProfilerActivity, profile as profiler
    with profiler(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        seconds, tokens = timed()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=18), file=sys.stderr)
else:
    seconds, tokens = timed()
print(json.dumps({"load_s": load_s, "generate_s": seconds, "tokens": tokens}))
"""

# Another GPU job's small kernels (a tiny policy's decode steps), until killed.
NEIGHBOUR = r"""
import torch
x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
w = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
while True:
    for _ in range(40):
        x = torch.tanh(x @ w)
    torch.cuda.synchronize()
"""

CPU_HOG = "while True: pass"


def add_options(parser: argparse._ArgumentGroup) -> None:
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="a policy checkpoint (default: the nano policy, built here with random weights)")
    parser.add_argument("--profile-cudnn", action="store_true", help="profile with cuDNN's attention allowed")


def build_policy(where: Path) -> Path:
    from kpipe.train.tiny_model import tiny_model_job

    return tiny_model_job(where / "nano-bpe4000", size="nano", seed=0, tokenizer="bpe", vocab_size=4000)


def run_variant(model_dir: Path, policy: bool, logprobs: bool, early: bool, profile: bool = False,
                beside: str | None = None, cudnn: bool = False) -> tuple[dict, str, float]:
    """One variant in a fresh process, optionally beside `beside` (python code) run as many times as
    the machine has cores ("cpu") or once ("gpu"); returns its JSON, stderr and process seconds."""
    neighbours = []
    if beside == "cpu":
        neighbours = [subprocess.Popen([sys.executable, "-c", CPU_HOG]) for _ in range(os.cpu_count() or 1)]
    elif beside == "gpu":
        neighbours = [subprocess.Popen([sys.executable, "-c", NEIGHBOUR])]
        time.sleep(4)  # its CUDA context is up
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-c", VARIANT, str(model_dir), *(str(int(flag)) for flag in
                                                                                  (policy, logprobs, early, profile)),
                               str(REQUESTS), str(MAX_TOKENS), str(int(cudnn))],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
    finally:
        for process in neighbours:
            process.kill()
            process.wait()
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise CheckFailed(f"variant policy={policy} logprobs={logprobs} early={early} failed: {done.stderr[-800:]}")
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr, wall


def variants(report: Report, options: argparse.Namespace) -> None:
    """Each variant's generate() seconds and tokens/s, from a fresh process each."""
    with tempfile.TemporaryDirectory(prefix="kpipe-rlgen-") as scratch:
        model_dir = options.model_dir or build_policy(Path(scratch))
        report.line(f"policy: `{model_dir}`; {REQUESTS} requests of at most {MAX_TOKENS} tokens, temperature 1, "
                    "4 bank prompts; after a warm-up generate() in the same process")
        report.table("variant", "generate s", "tokens", "tokens/s", "process s (load + warm-up)")
        cases = (("RL job's, cuDNN attention allowed (before)", dict(policy=True, logprobs=True, early=True,
                                                                     cudnn=True)),
                 ("engine (bf16)", dict(policy=False, logprobs=False, early=False)),
                 ("policy (fp32 + bf16 autocast)", dict(policy=True, logprobs=False, early=False)),
                 ("policy + logprobs", dict(policy=True, logprobs=True, early=False)),
                 ("policy + logprobs + early (an RL job)", dict(policy=True, logprobs=True, early=True)),
                 ("engine + logprobs + early", dict(policy=False, logprobs=True, early=True)),
                 ("RL job's, beside a busy process per core", dict(policy=True, logprobs=True, early=True,
                                                                   beside="cpu")),
                 ("RL job's, beside another process's CUDA kernels", dict(policy=True, logprobs=True, early=True,
                                                                          beside="gpu")),
                 ("engine, beside another process's CUDA kernels", dict(policy=False, logprobs=False, early=False,
                                                                        beside="gpu")))
        results = {}
        for name, case in cases:
            numbers, _, wall = run_variant(model_dir, **case)
            results[name] = numbers
            report.row(name, f"{numbers['generate_s']:.2f}", numbers["tokens"],
                       f"{numbers['tokens'] / numbers['generate_s']:.0f}", f"{wall:.1f} ({numbers['load_s']:.1f})")
        report.data.update(variants=results)
        _, profile, _ = run_variant(model_dir, policy=True, logprobs=True, early=True, profile=True,
                                    cudnn=options.profile_cudnn)
        report.line("", "`torch.profiler` of the RL job's variant (top operators by CPU time):", "", "```",
                    profile.strip()[-6000:], "```")


SECTIONS = (Section("variants", 120, variants),)
