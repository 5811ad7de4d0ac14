# Shared helpers: config validation, code versions, GPU counts, stage paths, target lists.
import os
import sys
from pathlib import Path

from kpipe.infra.config import ConfigError, deep_merge, load_schema, parse_nested_strings, validate_config
from kpipe.evaluate.kernelbench import budget_splits, model_gpus, models_by_name, validated_iterations
from kpipe.report.figures import FIGURE_NAMES
from kpipe.gym.run_service import announce, stop_services, withdraw
from kpipe.infra import warm_start
from kpipe.infra.gpu import visible_gpus
from kpipe.infra.provenance import code_version, job_code_version
from kpipe.infra.run_lock import clear_stale_lock
from kpipe.infra.snakemake_adapter import (command_line_config, default_resource_total, is_main_process,
                                           label_interrupted_jobs, resource_total, runs_here,
                                           until_stops_after_chained_rules)
from kpipe.report.tables import table_sql_files

# The default run; Snakemake merges --configfile files, then --config values, over it (mappings
# merge, lists and other values replace), so an overlay names only what it changes
# (config/paper.yaml sets or nulls every value of the small offline run that it must not inherit).
configfile: str(Path(workflow.basedir).parent / "config" / "config.yaml")


# nested --config values (kernelbench='{"size_cap": 128}') read as a config file would read them
config.update(deep_merge(config, {key: parse_nested_strings(value) for key, value in command_line_config(workflow).items()
                                  if isinstance(value, (dict, list))}))
try:
    validate_config(config, load_schema(Path(workflow.basedir) / "schemas" / "config.schema.yaml"))
except ConfigError as error:
    sys.exit(str(error))

RESULTS = "results"
LOGS = "logs"
RUN = config["run"]
DISTILL = config["distill"]
COLDSTART_DIR = f"{RESULTS}/trajectories/stage=coldstart/run={RUN}/iter=0"
if DISTILL["teacher"] == "released" and not (DISTILL["released_path"] and Path(DISTILL["released_path"]).exists()):
    # checked here: an earlier run's cold-start file would otherwise satisfy the rule and hide it
    sys.exit(f"config error: distill.released_path: {DISTILL['released_path']!r} does not exist "
             "(distill.teacher: released reads it)")


if is_main_process(workflow):
    clear_stale_lock()  # a killed run's lock: the same command runs again (kpipe.infra.run_lock)

# `--until rl_iter` runs every iteration (Snakemake would stop after the first: kpipe/infra/snakemake_adapter.py)
until_stops_after_chained_rules()
label_interrupted_jobs()  # a job rerun after an interruption is not "Forced execution" (snakemake_adapter)


def job_code(script, *parts):
    """A rule's `code` param: the hash of the kpipe `parts` it runs and of its script,
    workflow/scripts/<script>.py, by syntax tree (comments and docstrings do not count;
    kpipe.infra.provenance.job_code_version). A changed one reruns the rule's jobs. The profiles
    leave Snakemake's own `code` trigger off: for a script it compares the file's modification time,
    so a fresh clone (every file new) reran every job of a copied results/ tree."""
    return job_code_version(Path(workflow.basedir) / "scripts" / f"{script}.py", *parts)


# The offline teacher's answers are a function of its code and the bank: a job's cached answers (its
# `cache` param) are kept per teacher version, so a changed teacher answers again; an API model's
# cached answers (paid for) stay valid whatever kpipe's code
TEACHER_VERSION = code_version("llm/teacher.py", "llm/server.py", "llm/extract.py", "llm/types.py",
                               "data/source_text.py", "gym/bank")


def answers_cache(path, offline_teacher):
    """A job's answer cache `path`, in a folder of the teacher's version when the offline teacher answers."""
    return str(Path(path).parent / f"teacher-{TEACHER_VERSION}" / Path(path).name) if offline_teacher else path


# asked once per DAG build (nvidia-smi), not once per rule
RUN_GPUS = visible_gpus()
USE_GPUS = config["device"] == "cuda" or (config["device"] == "auto" and len(RUN_GPUS) > 0)
SLOTS_PER_GPU = config["gpu"]["slots_per_gpu"]
DEFAULT_API_JOBS = 4
# a run on this machine, not a cluster (kpipe.infra.snakemake_adapter.runs_here)
RUNS_HERE = runs_here(workflow)


def register_default_resources():
    """Resource totals nobody gave (--resources, a profile): `api`, and `gpu_slots` for a local run.

    Not in workflow/profiles/default, which Snakemake applies on top of any --profile: its
    totals would override the cluster profile's and cap every job's request (resources are
    constrained by the totals). `gpu_slots` is only registered for a run on this machine, where
    jobs share GPUs by slots (kpipe.infra.gpu.gpu_slot_lease); `gpu` (the whole GPUs a job
    touches) is left uncapped: on a cluster it is what the executor turns into `sbatch --gpus`.
    """
    default_resource_total(workflow, "api", DEFAULT_API_JOBS)
    if RUNS_HERE:
        default_resource_total(workflow, "gpu_slots", len(RUN_GPUS) * SLOTS_PER_GPU if USE_GPUS else 0)


register_default_resources()
# whole GPUs a job of a local run may hold: the slot total's (all GPUs, or fewer by --resources gpu_slots=N)
LOCAL_GPUS = max(1, resource_total(workflow, "gpu_slots") // SLOTS_PER_GPU) if RUNS_HERE else None

# One KernelGym service per run and machine (kpipe.gym.run_service): jobs (child processes of this
# one) find it through the environment; it stops with the run, or by itself when this process ends.
GYM_SERVICE_DIR = f"{RESULTS}/.gym"
SHARED_GYM = config["gym"]["service"] == "auto" and config["gym"]["backend"] == "pool" and RUNS_HERE
if SHARED_GYM:
    announce(GYM_SERVICE_DIR, RUN_GPUS if USE_GPUS else [])
else:
    withdraw()


onstart:
    # a run, not a dry run (which plans anywhere, config/paper.yaml on a laptop too); a cluster's
    # login node may show no GPU: there the executor places jobs on GPU nodes
    if config["device"] == "cuda" and RUNS_HERE and not RUN_GPUS:
        sys.exit("config error: device: cuda (config/gpu.yaml and config/paper.yaml set it), but this "
                 "machine shows no GPU (nvidia-smi -L, CUDA_VISIBLE_DEVICES); on a CPU, run without them")
    # the heavy one-process jobs are forked from a process with torch and transformers imported
    # (kpipe.infra.warm_start): ~10 s less per job; it ends with this process. Its socket's name
    # and token reach the jobs (this process's children) through the environment
    if config["warm_start"] and RUNS_HERE:
        os.environ.update(warm_start.start(GYM_SERVICE_DIR, os.getpid()))


onsuccess:
    stop_services(GYM_SERVICE_DIR)
    warm_start.stop()


onerror:
    stop_services(GYM_SERVICE_DIR)
    warm_start.stop()


# distill -> sft -> rl_iter, the run's longest chain, and the jobs it waits for (ingest, decontaminate,
# the tiny model): when jobs compete for GPU slots or cores, Snakemake starts these first (the
# teacher's evaluations, STTS and the like fit beside them). A rule's priority does not pass to the
# jobs it depends on (only --prioritize does), so each of them names it: on 2 CPU cores the teacher's
# evaluations had taken a core before ingest_queries, and distillation began 17 s late
CRITICAL_PATH = 10

# the `gym` section as rules' params: `service` says where evaluations run, not what they give
GYM = {key: value for key, value in config["gym"].items() if key != "service"}
# ... and for that chain's jobs: their evaluations go first in the run's KernelGym service, whose
# queue serves the highest priority waiting (kpipe.gym.pool.JobQueue): on two H200s, RL
# iterations took 10-12 s instead of 4-5 while the evaluations only the report needs ran there
CRITICAL_GYM = {**GYM, "priority": CRITICAL_PATH}
# a small local policy shares its GPU; the real-size presets (qwen3-*: config/paper_smoke.yaml) take GPUs whole
TINY_POLICY = config["policy"]["base_model"] == "tiny" and not config["policy"]["tiny"]["size"].startswith("qwen3-")


def gpu_slots(gpus, small):
    """GPU slots of a GPU-stage job: none when the config or the machine says CPU; one when
    `small` (it shares a GPU: the nano policy, a one-task evaluation, STTS), else all slots of
    its `gpus` GPUs (on this machine at most LOCAL_GPUS)."""
    if not USE_GPUS:
        return 0
    return 1 if small else (gpus if LOCAL_GPUS is None else min(gpus, LOCAL_GPUS)) * SLOTS_PER_GPU


def whole_gpus(slots):
    """The GPUs a job of `slots` GPU slots touches (its `gpu` resource: process count, sbatch --gpus)."""
    return -(-slots // SLOTS_PER_GPU)


def evaluating_job_slots(small_model=True):
    """Slots of a job that evaluates: it shares a GPU only when the run's service times its
    kernels (a pool of its own would time them next to other jobs' work); whole when its model is not small."""
    return gpu_slots(1, SHARED_GYM and small_model)


def query_sources():
    return {source["name"]: source for source in config["queries"]["sources"]}


def coldstart_parts():
    """The cold-start trajectory files of this run (one per shard; one for released data)."""
    shards = 1 if DISTILL["teacher"] == "released" else DISTILL["shards"]
    return expand(f"{COLDSTART_DIR}/part-{{shard}}.parquet", shard=range(shards))


def sft_base_model_input():
    """The locally built tiny model when the config asks for it (else the base model is a param)."""
    policy = config["policy"]
    if policy["base_model"] != "tiny":
        return []
    tiny = policy["tiny"]
    tokenizer = "byte" if tiny["tokenizer"] == "byte" else f"bpe{tiny['vocab_size']}"
    return [f"{RESULTS}/models/tiny-{tiny['size']}-{tokenizer}-seed{tiny['seed']}"]


def sft_settings(base_inputs):
    """The SFTConfig values of the run: the `sft` section, the run name and the base model (the
    tiny model built here, `base_inputs` of sft_base_model_input, else the config's hub id or path)."""
    base_model = base_inputs[0] if base_inputs else config["policy"]["base_model"]
    return {**job_settings(config["sft"], drop=("gpus",)), "base_model": base_model, "run": RUN}


# The `evals` table of the DAG: the KernelGym result cache (gym.cache) written out by rules/db.smk
EVALS_EXPORT = f"{RESULTS}/evals/gym_cache.parquet"


def trajectory_parts():
    """The trajectory files of every stage, all of which evaluate through KernelGym (and so fill
    gym.cache; the released cold start, read rather than generated, is the one exception)."""
    return [
        *coldstart_parts(),
        *rl_parts("trajectories"),
        *rl_validation_parts(),
        *eval_parts(),
        *budget_parts(),
        *stts_parts(),
    ]


def table_files():
    """Every Parquet file the database views read, per table: the outputs of all stages. The views
    read exactly these (never other files on disk, e.g. left by other settings)."""
    return {
        "tasks": [f"{RESULTS}/tasks/tasks.parquet"],
        "queries": [f"{RESULTS}/queries/queries.parquet"],
        "train_metrics": [f"{RESULTS}/train_metrics/stage=sft/run={RUN}/part-0.parquet", *rl_parts("train_metrics")],
        "trajectories": trajectory_parts(),
        "evals": [EVALS_EXPORT],
    }


def final_targets():
    """The default targets: the database (every stage feeds it), the tables, the figures and the
    trajectory viewer (rules/viewer.smk), and every file the database reads: Snakemake reruns a
    deleted intermediate file (e.g. an interrupted job's output) only when a target asks for it."""
    return [f"{RESULTS}/kpipe.duckdb", *table_targets(), f"{RESULTS}/viewer",
            *(path for paths in table_files().values() for path in paths)]


# RL iterations (rules/rl.smk)
RL = config["rl"]
RL_ITERATIONS = RL["iterations"]
RL_DAG_KEYS = ("iterations", "runs", "base_run", "gpus", "keep_optimizer_states", "validation")  # not a result of rl_iter
RL_RUNS = {**({RUN: {}} if RL["base_run"] else {}), **RL["runs"]}
if not RL_RUNS:
    raise ValueError("config error: rl.base_run is false and rl.runs is empty: no RL run to train")


def rl_settings(run):
    """The RLConfig values of `run`: the `rl` section with the run's overlay on top."""
    base = {key: value for key, value in RL.items() if key not in RL_DAG_KEYS}
    return {**base, **RL_RUNS[run]}


def rl_model_dir(run, iteration):
    return f"{RESULTS}/models/rl-{run}/iter={iteration}"


def rl_state_dir(run, iteration):
    return f"{RESULTS}/work/rl-{run}/iter={iteration}/state"


def rl_init_model(wildcards):
    iteration = int(wildcards.iter)
    return f"{RESULTS}/models/sft-{RUN}" if iteration == 0 else rl_model_dir(wildcards.run, iteration - 1)


def rl_final_model(run=RUN):
    """The model of the last RL iteration of `run` (evaluated as `source: rl`)."""
    return rl_model_dir(run, RL_ITERATIONS - 1)


def rl_parts(kind):
    """Every RL iteration's `trajectories` or `train_metrics` file, over all runs."""
    return expand(f"{RESULTS}/{kind}/stage=rl/run={{run}}/iter={{iter}}/part-0.parquet",
                  run=list(RL_RUNS), iter=range(RL_ITERATIONS))


# RL validation (rules/rl.smk, rl_validate jobs): iteration checkpoints on the validation tasks
RL_VALIDATION = RL["validation"]
RL_VALIDATED_ITERATIONS = validated_iterations(RL_ITERATIONS, RL_VALIDATION["every"])
if RL_VALIDATED_ITERATIONS and RL_VALIDATION["level"] not in config["kernelbench"]["levels"]:
    sys.exit(f"config error: rl.validation.level: {RL_VALIDATION['level']} is not one of kernelbench.levels "
             f"{config['kernelbench']['levels']} (or set rl.validation.every: 0)")


def rl_validation_parts():
    """Every validation file: each run x validated iteration (none when rl.validation.every is 0)."""
    return expand(f"{RESULTS}/trajectories/stage=rl_val/run={{run}}/iter={{iter}}/part-0.parquet",
                  run=list(RL_RUNS), iter=RL_VALIDATED_ITERATIONS)


# KernelBench evaluation (rules/eval.smk)
MODELS = models_by_name(config["models"])
EVAL = config["eval"]
EVAL_DIR = f"{RESULTS}/trajectories/stage=eval/run={RUN}"
DAG_ONLY_KEYS = ("models", "levels", "strategies", "window", "enabled")  # shape the DAG, not one job's result


def job_settings(section, drop=DAG_ONLY_KEYS):
    """The part of a config section one job's result depends on (its params: a change reruns it)."""
    return {key: value for key, value in section.items() if key not in drop}


def stage_models(section):
    """The `models:` entries a stage runs (default: all of them; names checked below)."""
    return section.get("models") or list(MODELS)


for _stage in ("eval", "stts", "eval_budget"):
    _unknown = [name for name in config[_stage].get("models") or [] if name not in MODELS]
    if _unknown:
        sys.exit(f"config error: {_stage}.models: {', '.join(map(repr, _unknown))} not defined under models: "
                 f"(defined: {', '.join(MODELS)})")


def model_job_slots(wildcards):
    """GPU slots of an eval/STTS/budget job: one when its model is small (the offline teacher, an
    API model, the nano pipeline policy in process), else its model's GPUs whole (`vllm serve`'s
    tensor x data parallel, or one)."""
    entry = MODELS[wildcards.model]
    gpus = model_gpus(entry)
    small = entry["kind"] in ("offline_teacher", "openai") or (entry["kind"] == "pipeline" and TINY_POLICY and gpus == 1
                                                                and entry.get("serve") != "vllm")
    return evaluating_job_slots(small) if gpus == 1 else gpu_slots(gpus, False)


def model_job_gpus(wildcards):
    """Whole GPUs of an eval/STTS/budget job (its `gpu` resource)."""
    return whole_gpus(model_job_slots(wildcards))


def stage_levels(section):
    return section.get("levels") or config["kernelbench"]["levels"]


def pipeline_checkpoint(name, section=EVAL):
    """The checkpoint of a `kind: pipeline` model (an input, so it is built first): the SFT model, or its RL
    run's last checkpoint (`section["checkpoint"]`: last) or the file naming its best validated one
    (best_val: rule select_checkpoint, rules/eval.smk)."""
    entry = MODELS[name]
    if entry["kind"] != "pipeline":
        return []
    if entry["source"] == "sft":
        return f"{RESULTS}/models/sft-{RUN}"
    run = entry.get("rl_run") or RUN  # which RL run's checkpoint (rules/rl.smk)
    if run not in RL_RUNS:
        raise ValueError(f"config error: models.{name}.rl_run: {run!r} is not an RL run ({', '.join(RL_RUNS)})")
    return rl_selection(run) if section["checkpoint"] == "best_val" else rl_final_model(run)


def rl_selection(run):
    """The file naming the RL checkpoint of `run` that best_val evaluates (rule select_checkpoint)."""
    if not RL_VALIDATED_ITERATIONS:
        raise ValueError("config error: eval.checkpoint / stts.checkpoint: best_val needs RL validation "
                         "(rl.validation.every > 0)")
    return f"{RESULTS}/models/rl-{run}/selected.json"


def checkpoint_selections():
    """Every selection file an evaluating stage reads (none under eval.checkpoint and stts.checkpoint last)."""
    stages = [(EVAL, stage_models(EVAL)), (STTS, stage_models(STTS) if STTS["enabled"] else []),
              (EVAL, stage_models(BUDGET) if BUDGET["models"] else [])]
    return sorted({pipeline_checkpoint(name, section) for section, names in stages for name in names
                   if MODELS[name]["kind"] == "pipeline" and MODELS[name]["source"] == "rl"
                   and section["checkpoint"] == "best_val"})


def eval_parts():
    return expand(f"{EVAL_DIR}/model={{model}}/level={{level}}/part-{{shard}}.parquet",
                  model=stage_models(EVAL), level=stage_levels(EVAL), shard=range(EVAL["shards"]))


# Kevin's test-time budget (rules/eval.smk): the evaluation's settings, the budget's splits
BUDGET = config["eval_budget"]
BUDGET_DIR = f"{RESULTS}/trajectories/stage=budget/run={RUN}"
BUDGET_SETTINGS = {**job_settings(EVAL, drop=(*DAG_ONLY_KEYS, "samples", "turns", "shards")),
                   "kernels": BUDGET["kernels"], "turns": BUDGET["turns"]}
try:
    budget_splits(BUDGET["kernels"], BUDGET["turns"])
except ValueError as error:
    sys.exit(f"config error: {error}")


def budget_parts():
    """Every budget file: eval_budget.models x levels (default: the evaluation's) x shards; none
    when eval_budget.models is empty."""
    if not BUDGET["models"]:
        return []
    return expand(f"{BUDGET_DIR}/model={{model}}/level={{level}}/part-{{shard}}.parquet",
                  model=stage_models(BUDGET), level=BUDGET["levels"] or stage_levels(EVAL),
                  shard=range(BUDGET["shards"]))


# Sequential test-time scaling (rules/stts.smk)
STTS = config["stts"]
STTS_DIR = f"{RESULTS}/trajectories/stage=stts/run={RUN}"


def stts_parts():
    if not STTS["enabled"]:
        return []
    return expand(f"{STTS_DIR}/model={{model}}/strategy={{strategy}}/level={{level}}/part-{{shard}}.parquet",
                  model=stage_models(STTS), strategy=STTS["strategies"], level=stage_levels(STTS),
                  shard=range(STTS["shards"]))


# Tables and figures (rules/tables.smk)
# relative to the working directory, as every other path of the DAG: a moved tree reruns nothing
SQL_DIR = Path(os.path.relpath(Path(workflow.current_basedir).parent / "sql"))


def sql_file(name):
    """workflow/sql/<name>.sql, as a path relative to the working directory."""
    return str(SQL_DIR / f"{name}.sql")
TABLE_NAMES = [path.stem for path in table_sql_files(SQL_DIR)]


def own_models():
    """The models the Fast@p tables report at their last turn (tables.own_models; default: kind pipeline)."""
    named = config["tables"]["own_models"]
    return named if named is not None else [entry["name"] for entry in config["models"] if entry["kind"] == "pipeline"]


def report_tables():
    outputs = []
    for name in TABLE_NAMES:
        outputs.append(report(f"{RESULTS}/tables/{name}.md", caption=f"../report/{name}.rst", category="Tables",
                              labels={"table": name, "format": "markdown"}))
        outputs.append(report(f"{RESULTS}/tables/{name}.csv", caption=f"../report/{name}.rst", category="Tables",
                              labels={"table": name, "format": "csv"}))
    return outputs


def table_targets():
    """The default targets of this module: every table and figure."""
    return ([f"{RESULTS}/tables/{name}.{ext}" for name in TABLE_NAMES for ext in ("md", "csv")]
            + [f"{RESULTS}/figures/{name}.png" for name in FIGURE_NAMES])
