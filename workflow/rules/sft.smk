# SFT: the tiny offline policy (when config says so), then supervised fine-tuning on the
# cold-start trajectories. Checkpoints live outside the declared outputs, so a killed job
# rerun by Snakemake resumes from its last checkpoint (kpipe.train.sft); a config change
# changes the run's fingerprint and starts over.


rule tiny_model:
    output:
        directory(f"{RESULTS}/models/tiny-{{size}}-seed{{seed}}"),
    params:
        code=code_version("train/tiny_model.py"),
    log:
        f"{LOGS}/tiny_model/{{size}}-seed{{seed}}.log",
    wildcard_constraints:
        size="[a-z0-9.-]+",
        seed="[0-9]+",
    conda:
        "../envs/kpipe.yaml"
    shell:
        "kpipe train tiny-model {output} --size {wildcards.size} --seed {wildcards.seed} > {log} 2>&1"


rule sft:
    input:
        trajectories=coldstart_parts(),
        base=sft_base_model_input(),
    output:
        model=directory(f"{RESULTS}/models/sft-{RUN}"),
        metrics=f"{RESULTS}/train_metrics/stage=sft/run={RUN}/part-0.parquet",
        summary=f"{RESULTS}/reports/sft-{RUN}.json",
    params:
        sft=config["sft"],
        run=RUN,
        base_model=config["policy"]["base_model"],
        work=f"{RESULTS}/work/sft-{RUN}",
        code=code_version("train/sft.py", "train/samples.py", "train/checkpoint.py", "train/metrics_log.py",
                          "data/schemas.py"),
    resources:
        gpu=gpus_per_job(config["sft"].get("gpus", 1)),
    benchmark:
        f"{LOGS}/benchmarks/sft-{RUN}.tsv"
    log:
        f"{LOGS}/sft-{RUN}.log",
    conda:
        "../envs/kpipe.yaml"
    script:
        "../scripts/sft.py"
