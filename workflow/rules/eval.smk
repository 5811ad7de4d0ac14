# KernelBench evaluation (paper §6.1): every model of `eval.models` x level x shard is one job
# (a GPU slot of a small model, whose kernels the run's KernelGym service times; else a whole GPU,
# or a `serve: vllm` model's server's GPUs: timing and generation are contention-sensitive), n samples x
# T turns through the one agent loop; rows are `trajectories` with stage=eval. One evaluation
# times the candidate against eager PyTorch and torch.compile, so Tables 1 and 2 share the rows.
# Answers of API models and all evaluations are cached under results/cache/eval/ (not outputs:
# a killed job keeps them and its rerun pays for nothing twice).


rule eval:
    """kpipe.evaluate.kernelbench.eval_job: one KernelBench shard of one model and level."""
    input:
        tasks=TASKS,
        checkpoint=lambda wildcards: pipeline_checkpoint(wildcards.model),
    output:
        f"{EVAL_DIR}/model={{model}}/level={{level}}/part-{{shard}}.parquet",
    params:
        settings=job_settings(EVAL),
        model=lambda wildcards: MODELS[wildcards.model],
        gym=GYM,
        num_shards=EVAL["shards"],
        run=RUN,
        cache=lambda wildcards: answers_cache(f"{RESULTS}/cache/eval/run={RUN}/{wildcards.model}-L{wildcards.level}"
                                              f"-{wildcards.shard}.jsonl",
                                              MODELS[wildcards.model]["kind"] == "offline_teacher"),
        code=job_code("eval", "evaluate/kernelbench.py", "agent", "llm", "gym"),
    wildcard_constraints:
        model="[A-Za-z0-9_.-]+",
        level="[123]",
        shard=r"\d+",
    resources:
        gpu_slots=model_job_slots,
        gpu=model_job_gpus,
        api=lambda wildcards: 1 if MODELS[wildcards.model]["kind"] == "openai" else 0,
    benchmark:
        f"{LOGS}/benchmarks/eval/run={RUN}/{{model}}-L{{level}}-{{shard}}.tsv"
    log:
        f"{LOGS}/eval/run={RUN}/{{model}}-L{{level}}-{{shard}}.log",
    conda:
        "../envs/kpipe.yaml"
    script:
        "../scripts/eval.py"


# Checkpoint selection (config eval.checkpoint / stts.checkpoint: best_val; paper Figure 4: "we select
# checkpoints based on turn 3 performance"): a `source: rl` model is then its RL run's validated iteration
# with the best validation Fast@1 at the validation's last turn (rl.validation.turns; the paper's 3), ties
# to Fast@1.2, then the later iteration. The evaluations read the chosen directory from this file
# (kpipe.evaluate.kernelbench.resolved_checkpoint) and label their rows with its iteration; the tables quote
# the choice and its score.


rule select_checkpoint:
    """kpipe.evaluate.kernelbench.selection_job: the RL checkpoint best_val evaluates, by its validation."""
    input:
        lambda wildcards: expand(f"{RESULTS}/trajectories/stage=rl_val/{RL_ROOT}/run={wildcards.run}/iter={{iter}}/part-0.parquet",
                                 iter=RL_VALIDATED_ITERATIONS),
    output:
        f"{RESULTS}/models/{RL_ROOT}/{{run}}/selected.json",
    params:
        checkpoints=lambda wildcards: {iteration: rl_model_dir(wildcards.run, iteration)
                                       for iteration in RL_VALIDATED_ITERATIONS},
        turn=RL_VALIDATION["turns"],
        code=job_code("select_checkpoint", "evaluate/kernelbench.py", "data/metrics.py"),
    wildcard_constraints:
        run="[A-Za-z0-9_.-]+",
    log:
        f"{LOGS}/select_checkpoint/{RL_ROOT}/{{run}}.log",
    conda:
        "../envs/kpipe.yaml"
    script:
        "../scripts/select_checkpoint.py"


# Kevin's test-time budget (Kevin-32B §5.3-5.4; config eval_budget): each model of eval_budget.models x
# level x shard spends eval_budget.kernels generated kernels per task once per split into trajectories x
# turns (one split per entry of eval_budget.turns), with the evaluation's sampling, seed and gym; rows
# stage=budget, model "<model>@<trajectories>x<turns>" (table kevin_budget, figure fig_kevin_budget).
rule eval_budget:
    """kpipe.evaluate.kernelbench.budget_job: Kevin's budget splits of one model, level and shard."""
    input:
        tasks=TASKS,
        checkpoint=lambda wildcards: pipeline_checkpoint(wildcards.model),
    output:
        f"{BUDGET_DIR}/model={{model}}/level={{level}}/part-{{shard}}.parquet",
    params:
        settings=BUDGET_SETTINGS,
        model=lambda wildcards: MODELS[wildcards.model],
        gym=GYM,
        num_shards=BUDGET["shards"],
        run=RUN,
        cache=lambda wildcards: answers_cache(f"{RESULTS}/cache/budget/run={RUN}/{wildcards.model}-L{wildcards.level}"
                                              f"-{wildcards.shard}.jsonl",
                                              MODELS[wildcards.model]["kind"] == "offline_teacher"),
        code=job_code("eval_budget", "evaluate/kernelbench.py", "agent", "llm", "gym"),
    wildcard_constraints:
        model="[A-Za-z0-9_.-]+",
        level="[123]",
        shard=r"\d+",
    resources:
        gpu_slots=model_job_slots,
        gpu=model_job_gpus,
        api=lambda wildcards: 1 if MODELS[wildcards.model]["kind"] == "openai" else 0,
    benchmark:
        f"{LOGS}/benchmarks/eval_budget/run={RUN}/{{model}}-L{{level}}-{{shard}}.tsv"
    log:
        f"{LOGS}/eval_budget/run={RUN}/{{model}}-L{{level}}-{{shard}}.log",
    conda:
        "../envs/kpipe.yaml"
    script:
        "../scripts/eval_budget.py"
