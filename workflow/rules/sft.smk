# SFT: the tiny offline policy (when config says so), then supervised fine-tuning on the
# cold-start trajectories. Checkpoints and the metrics so far live in results/work (not an
# output), so a killed job rerun by Snakemake resumes from its last checkpoint
# (kpipe.train.sft) and keeps the loss rows before it, when the checkpoint's restart key (settings,
# data, code, base weights, library versions) is the job's; else it starts over and its log says
# which part changed. A finished run drops its checkpoints: a forced rerun trains again. `sft.gpus` decides the process count:
# `kpipe launch` runs one process per GPU (FSDP2 from two); one process (a CPU, one GPU) runs in the
# job's own (kpipe.infra.jobs.run_job).

import json

from kpipe.infra.provenance import SFT_CODE

# the nano policy on one GPU shares it; a real model takes its GPUs whole
SFT_SLOTS = gpu_slots(config["sft"]["gpus"], TINY_POLICY and config["sft"]["gpus"] == 1)
# the built policy; a real-size preset's (the 8B: 16.4 GB of random bf16 weights) is temporary: Snakemake deletes it
# once SFT, its one reader, has run, and rebuilds it from its seed (the same bytes) if SFT must run again
TINY_MODEL_DIR = directory(f"{RESULTS}/models/tiny-{{size}}-{{tokenizer}}-seed{{seed}}")


rule tiny_model:
    """kpipe.train.tiny_model.tiny_model_job: the random-weight tiny policy and its tokenizer."""
    output:
        temp(TINY_MODEL_DIR) if config["policy"]["tiny"]["size"].startswith("qwen3-") else TINY_MODEL_DIR,
    params:
        # byte | bpe<vocab size>; the BPE is trained on the templates, the bank and KernelBench
        tokenizer=lambda wildcards: ({"tokenizer": "byte"} if wildcards.tokenizer == "byte"
                                     else {"tokenizer": "bpe", "vocab_size": int(wildcards.tokenizer[3:])}),
        code=job_code("tiny_model", "train/tiny_model.py", "llm/prompts", "gym/bank", "data/files/kernelbench"),
    priority: CRITICAL_PATH
    log:
        f"{LOGS}/tiny_model/{{size}}-{{tokenizer}}-seed{{seed}}.log",
    wildcard_constraints:
        size="[a-z0-9.-]+",
        tokenizer="byte|bpe[0-9]+",
        seed="[0-9]+",
    conda:
        "../envs/kpipe.yaml"
    script:
        "../scripts/tiny_model.py"


rule sft:
    """kpipe.train.sft.sft_job: supervised fine-tuning (kpipe.train.sft.train_sft), in one process per GPU."""
    input:
        trajectories=coldstart_parts(),
        base=sft_base_model_input(),
    output:
        model=directory(f"{RESULTS}/models/sft-{RUN}"),
        metrics=f"{RESULTS}/train_metrics/stage=sft/run={RUN}/part-0.parquet",
        summary=f"{RESULTS}/reports/sft-{RUN}.json",
    params:
        # a plain value, not a function of `input`: Snakemake leaves params derived from input out of
        # its params rerun trigger, so a changed `sft` section would not rerun this job
        settings=json.dumps(sft_settings(sft_base_model_input()), sort_keys=True),
        work=f"{RESULTS}/work/sft-{RUN}",
        code=job_code("sft", *SFT_CODE),
    priority: CRITICAL_PATH
    resources:
        gpu_slots=SFT_SLOTS,
        gpu=whole_gpus(SFT_SLOTS),
    benchmark:
        f"{LOGS}/benchmarks/sft-{RUN}.tsv"
    log:
        f"{LOGS}/sft-{RUN}.log",
    conda:
        "../envs/kpipe.yaml"
    script:
        "../scripts/sft.py"
