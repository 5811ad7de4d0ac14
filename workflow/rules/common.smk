# What every stage shares: the config (loaded, validated), the roots of the paths, code versions,
# GPU resources and the run's services. Each stage's own paths and input functions are in
# rules/inputs.smk, its rules in rules/<stage>.smk; the Python they call is kpipe's.
import sys
from pathlib import Path

from kpipe.infra.config import ConfigError, deep_merge, load_schema, parse_nested_strings, validate_config
from kpipe.infra.gpu import visible_gpus
from kpipe.infra.provenance import code_version, job_code_version
from kpipe.infra.run_lock import clear_stale_lock
from kpipe.infra.snakemake_adapter import (command_line_config, default_resource_total, is_main_process,
                                           label_interrupted_jobs, resource_total, runs_here,
                                           until_stops_after_chained_rules)
from kpipe.workflow.services import RunServices, ServiceError, check_devices

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

# The run's services (kpipe.workflow.services: the KernelGym service its jobs share), started before
# the first job and stopped with the run
SERVICES = RunServices.of_run(config, f"{RESULTS}/.gym", RUN_GPUS if USE_GPUS else [], RUNS_HERE)
SHARED_GYM = SERVICES.shared_gym


onstart:
    try:
        check_devices(config, RUN_GPUS, RUNS_HERE)
    except ServiceError as error:
        sys.exit(str(error))
    SERVICES.start()


onsuccess:
    SERVICES.stop()


onerror:
    SERVICES.stop()


# distill -> sft -> rl_iter, the run's longest chain, and the jobs it waits for (ingest, decontaminate,
# the tiny model) start first when jobs compete for GPU slots or cores. A rule's priority does not
# pass to the jobs it depends on (only --prioritize does), so each of them names it
CRITICAL_PATH = 10

# the `gym` section as rules' params: `service` says where evaluations run, not what they give
GYM = {key: value for key, value in config["gym"].items() if key != "service"}
# ... and for that chain's jobs: their evaluations go first in the run's KernelGym service, whose
# queue serves the highest priority waiting (kpipe.gym.serve.pool.JobQueue)
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


DAG_ONLY_KEYS = ("models", "levels", "strategies", "window", "enabled")  # shape the DAG, not one job's result


def job_settings(section, drop=DAG_ONLY_KEYS):
    """The part of a config section one job's result depends on (its params: a change reruns it)."""
    return {key: value for key, value in section.items() if key not in drop}
