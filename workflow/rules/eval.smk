# KernelBench evaluation (paper §6.1): every model of `eval.models` x level x shard is one job
# (`resources: gpu=1`: timing is contention-sensitive, one GPU per evaluation job), n samples x
# T turns through the one agent loop; rows are `trajectories` with stage=eval. One evaluation
# times the candidate against eager PyTorch and torch.compile, so Tables 1 and 2 share the rows.
# Answers of API models and all evaluations are cached under results/cache/eval/ (not outputs:
# a killed job keeps them and its rerun pays for nothing twice).
from kpipe.evaluation import models_by_name

MODELS = models_by_name(config["models"])
EVAL = config["eval"]
EVAL_DIR = f"{RESULTS}/trajectories/stage=eval/run={RUN}"
DAG_ONLY_KEYS = ("models", "levels", "strategies", "window", "enabled")  # shape the DAG, not one job's result


def job_settings(section, drop=DAG_ONLY_KEYS):
    """The part of a config section one job's result depends on (its params: a change reruns it)."""
    return {key: value for key, value in section.items() if key not in drop}


def stage_models(section):
    """The `models:` entries a stage runs (default: all of them)."""
    names = section.get("models") or list(MODELS)
    unknown = [name for name in names if name not in MODELS]
    if unknown:
        raise ValueError(f"config: {', '.join(unknown)} named in a stage but not defined under models:")
    return names


def stage_levels(section):
    return section.get("levels") or config["kernelbench"]["levels"]


def pipeline_checkpoint(name):
    """The checkpoint directory of a `kind: pipeline` model (an input, so it is built first)."""
    entry = MODELS[name]
    if entry["kind"] != "pipeline":
        return []
    if entry["source"] == "sft":
        return f"{RESULTS}/models/sft-{RUN}"
    return rl_final_model()  # rules/rl.smk: the directory of the last RL iteration's checkpoint


def eval_parts():
    return expand(f"{EVAL_DIR}/model={{model}}/level={{level}}/part-{{shard}}.parquet",
                  model=stage_models(EVAL), level=stage_levels(EVAL), shard=range(EVAL["shards"]))


rule eval:
    input:
        tasks=f"{RESULTS}/tasks/tasks.parquet",
        checkpoint=lambda wildcards: pipeline_checkpoint(wildcards.model),
    output:
        f"{EVAL_DIR}/model={{model}}/level={{level}}/part-{{shard}}.parquet",
    params:
        settings=job_settings(EVAL),
        model=lambda wildcards: MODELS[wildcards.model],
        protocol=config.get("gym", {}).get("protocol", {}),
        num_shards=EVAL["shards"],
        run=RUN,
        cache=lambda wildcards: (f"{RESULTS}/cache/eval/run={RUN}/{wildcards.model}-L{wildcards.level}"
                                 f"-{wildcards.shard}.jsonl"),
        code=code_version("evaluation.py", "agent", "llm", "gym"),
    wildcard_constraints:
        model="[A-Za-z0-9_.-]+",
        level="[123]",
        shard=r"\d+",
    resources:
        gpu=gpus_per_job(1),
        api=lambda wildcards: 1 if MODELS[wildcards.model]["kind"] == "openai" else 0,
    benchmark:
        f"{LOGS}/benchmarks/eval/run={RUN}/{{model}}-L{{level}}-{{shard}}.tsv"
    log:
        f"{LOGS}/eval/run={RUN}/{{model}}-L{{level}}-{{shard}}.log",
    conda:
        "../envs/kpipe.yaml"
    script:
        "../scripts/eval.py"
