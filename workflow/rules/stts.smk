# Sequential test-time scaling (paper §6.3, Figure 6): each model of `stts.models` x strategy
# (full = vanilla extrapolation; top_w = the paper's context management; best_window = the
# released code's contiguous window) x level x shard runs `stts.max_turns` turns; stage=stts.
# The window w is a param of the top_w / best_window jobs only: changing it reruns those jobs
# and what reads them (build_db, tables, figures), never the evaluation or the vanilla run.
# Needs rules/eval.smk (models, helpers).


rule stts:
    """kpipe.evaluate.stts.stts_job: one STTS shard of one model, history strategy and level."""
    input:
        tasks=TASKS,
        checkpoint=lambda wildcards: pipeline_checkpoint(wildcards.model, STTS),
    output:
        f"{STTS_DIR}/model={{model}}/strategy={{strategy}}/level={{level}}/part-{{shard}}.parquet",
    params:
        settings=job_settings(STTS),
        window=lambda wildcards: None if wildcards.strategy == "full" else STTS["window"],
        model=lambda wildcards: MODELS[wildcards.model],
        gym=GYM,
        num_shards=STTS["shards"],
        run=RUN,
        cache=lambda wildcards: answers_cache(f"{RESULTS}/cache/stts/run={RUN}/{wildcards.model}-{wildcards.strategy}"
                                              f"-L{wildcards.level}-{wildcards.shard}.jsonl",
                                              MODELS[wildcards.model]["kind"] == "offline_teacher"),
        code=job_code("stts", "evaluate/stts.py", "evaluate/kernelbench.py", "agent", "llm", "gym"),
    wildcard_constraints:
        model="[A-Za-z0-9_.-]+",
        strategy="full|top_w|best_window",
        level="[123]",
        shard=r"\d+",
    resources:
        gpu_slots=model_job_slots,
        gpu=model_job_gpus,
        api=lambda wildcards: 1 if MODELS[wildcards.model]["kind"] == "openai" else 0,
    benchmark:
        f"{LOGS}/benchmarks/stts/run={RUN}/{{model}}-{{strategy}}-L{{level}}-{{shard}}.tsv"
    log:
        f"{LOGS}/stts/run={RUN}/{{model}}-{{strategy}}-L{{level}}-{{shard}}.log",
    conda:
        "../envs/kpipe.yaml"
    script:
        "../scripts/stts.py"
