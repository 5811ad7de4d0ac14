# Each stage's paths and input functions (what its rules in rules/<stage>.smk read), in the order of
# the stages; functions only, no rules (Snakemake's lint wants the two apart). Included after
# rules/common.smk (the config, resources and services) and before the rule modules.
import hashlib
import json
import os

from kpipe.evaluate.kernelbench import budget_splits, model_gpus, models_by_name, validated_iterations
from kpipe.report.figures import FIGURE_NAMES
from kpipe.report.tables import table_sql_files


def settings_key(*sections):
    """A short digest of config sections: the name of outputs shared by every config whose sections agree."""
    return hashlib.sha256(json.dumps(sections, sort_keys=True, default=str).encode()).hexdigest()[:12]


# Ingest and distillation (rules/ingest.smk, rules/distill.smk). Shared where the paper shares them, keyed by
# what makes them differ (never by the config's `run`): the tasks by the `kernelbench` section, the queries by
# it and the `queries` section, the cold start by those and what distils it (`distill`, the gym's verdicts), so
# config/paper.yaml and config/paper_14b.yaml read one cold start and config/kevin.yaml's split has its own.
TASKS_KEY = settings_key(config["kernelbench"])
TASKS = f"{RESULTS}/tasks/kernelbench={TASKS_KEY}/tasks.parquet"
QUERIES_KEY = settings_key(config["kernelbench"], config["queries"])
QUERIES = f"{RESULTS}/queries/queries={QUERIES_KEY}/queries.parquet"
DISTILL = config["distill"]
if DISTILL["teacher"] == "released" and not (DISTILL["released_path"] and Path(DISTILL["released_path"]).exists()):
    # checked here: an earlier run's cold-start file would otherwise satisfy the rule and hide it
    sys.exit(f"config error: distill.released_path: {DISTILL['released_path']!r} does not exist "
             "(distill.teacher: released reads it)")
# the cold start's name: its `run` column, its folder; the teacher's answer cache is keyed by the teacher (its
# answers by request hash: the query and the turn's prompt), shared by every cold start that teacher distils
COLDSTART = f"coldstart-{settings_key(config['kernelbench'], config['queries'], DISTILL, GYM)}"
COLDSTART_DIR = f"{RESULTS}/trajectories/stage=coldstart/run={COLDSTART}/iter=0"
TEACHER = (DISTILL.get("engine") or {}).get("model") or DISTILL["teacher"]


def query_sources():
    return {source["name"]: source for source in config["queries"]["sources"]}


def raw_query_parts():
    """Each source's ingested queries, keyed by its own entry (a decontamination setting re-ingests nothing)."""
    return [f"{RESULTS}/queries_raw/source={name}/key={settings_key(source)}/part-0.parquet"
            for name, source in query_sources().items()]


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


# RL iterations (rules/rl.smk)
RL = config["rl"]
RL_ITERATIONS = RL["iterations"]
RL_DAG_KEYS = ("iterations", "runs", "base_run", "gpus", "keep_optimizer_states", "final_checkpoint",
               "validation")  # not a result of rl_iter
RL_RUNS = {**({RUN: {}} if RL["base_run"] else {}), **RL["runs"]}
if not RL_RUNS:
    raise ValueError("config error: rl.base_run is false and rl.runs is empty: no RL run to train")


def rl_settings(run):
    """The RLConfig values of `run`: the `rl` section with the run's overlay on top."""
    base = {key: value for key, value in RL.items() if key not in RL_DAG_KEYS}
    return {**base, **RL_RUNS[run]}


# RL runs are the config's: `rl-<config run>/<RL run>` (paper.yaml's and paper_14b.yaml's `drkernel` are two runs)
RL_ROOT = f"rl-{RUN}"


def rl_model_dir(run, iteration):
    return f"{RESULTS}/models/{RL_ROOT}/{run}/iter={iteration}"


def rl_state_dir(run, iteration):
    return f"{RESULTS}/work/{RL_ROOT}/{run}/iter={iteration}/state"


def rl_export(iteration):
    """What iteration `iteration` writes (kpipe.train.rl.rl_job's `export`): `rl.final_checkpoint` for a run's
    last iteration, a trainer checkpoint for every other (the next iteration trains from it)."""
    return RL["final_checkpoint"] if int(iteration) == RL_ITERATIONS - 1 else "trainer"


def rl_init_model(wildcards):
    iteration = int(wildcards.iter)
    return f"{RESULTS}/models/sft-{RUN}" if iteration == 0 else rl_model_dir(wildcards.run, iteration - 1)


def rl_final_model(run=RUN):
    """The model of the last RL iteration of `run` (evaluated as `source: rl`)."""
    return rl_model_dir(run, RL_ITERATIONS - 1)


def rl_parts(kind):
    """Every RL iteration's `trajectories` or `train_metrics` file, over all runs."""
    return expand(f"{RESULTS}/{kind}/stage=rl/{RL_ROOT}/run={{run}}/iter={{iter}}/part-0.parquet",
                  run=list(RL_RUNS), iter=range(RL_ITERATIONS))


# RL validation (rules/rl.smk, rl_validate jobs): iteration checkpoints on the validation tasks
RL_VALIDATION = RL["validation"]
RL_VALIDATED_ITERATIONS = validated_iterations(RL_ITERATIONS, RL_VALIDATION["every"])
if RL_VALIDATED_ITERATIONS and RL_VALIDATION["level"] not in config["kernelbench"]["levels"]:
    sys.exit(f"config error: rl.validation.level: {RL_VALIDATION['level']} is not one of kernelbench.levels "
             f"{config['kernelbench']['levels']} (or set rl.validation.every: 0)")


def rl_validation_parts():
    """Every validation file: each run x validated iteration (none when rl.validation.every is 0)."""
    return expand(f"{RESULTS}/trajectories/stage=rl_val/{RL_ROOT}/run={{run}}/iter={{iter}}/part-0.parquet",
                  run=list(RL_RUNS), iter=RL_VALIDATED_ITERATIONS)


# KernelBench evaluation (rules/eval.smk)
MODELS = models_by_name(config["models"])
EVAL = config["eval"]
EVAL_DIR = f"{RESULTS}/trajectories/stage=eval/run={RUN}"


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
    return f"{RESULTS}/models/{RL_ROOT}/{run}/selected.json"


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


# The database, tables, figures and viewer of this config (rules/db.smk, tables.smk, viewer.smk): a folder of
# its own per config run and set of RL runs (an ablation overlay adds RL runs), so configs sharing one results/
# never rebuild each other's report; every row's `run` column says which run it comes from
REPORT_NAME = "+".join([RUN, *sorted(RL_RUNS)])
REPORT_DIR = f"{RESULTS}/runs/{REPORT_NAME}"
REPORT_LOGS = f"{LOGS}/runs/{REPORT_NAME}"


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
        outputs.append(report(f"{REPORT_DIR}/tables/{name}.md", caption=f"../report/{name}.rst", category="Tables",
                              labels={"table": name, "format": "markdown"}))
        outputs.append(report(f"{REPORT_DIR}/tables/{name}.csv", caption=f"../report/{name}.rst", category="Tables",
                              labels={"table": name, "format": "csv"}))
    return outputs


def table_targets():
    """The default targets of this module: every table and figure."""
    return ([f"{REPORT_DIR}/tables/{name}.{ext}" for name in TABLE_NAMES for ext in ("md", "csv")]
            + [f"{REPORT_DIR}/figures/{name}.png" for name in FIGURE_NAMES])


# The `evals` table of the DAG: the KernelGym result cache (gym.cache) written out by rules/db.smk
EVALS_EXPORT = f"{REPORT_DIR}/evals/gym_cache.parquet"


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
        "tasks": [TASKS],
        "queries": [QUERIES],
        "train_metrics": [f"{RESULTS}/train_metrics/stage=sft/run={RUN}/part-0.parquet", *rl_parts("train_metrics")],
        "trajectories": trajectory_parts(),
        "evals": [EVALS_EXPORT],
    }


def final_targets():
    """The default targets: the database (every stage feeds it), the tables, the figures and the
    trajectory viewer (rules/viewer.smk), and every file the database reads: Snakemake reruns a
    deleted intermediate file (e.g. an interrupted job's output) only when a target asks for it."""
    return [f"{REPORT_DIR}/kpipe.duckdb", *table_targets(), f"{REPORT_DIR}/viewer",
            *(path for paths in table_files().values() for path in paths)]
