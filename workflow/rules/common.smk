# Shared helpers: config validation, code versions, GPU counts, stage paths, target lists.
import sys
from pathlib import Path

from kpipe.config import ConfigError, load_schema, validate_config
from kpipe.gpu import gpu_count
from kpipe.provenance import code_version

try:
    validate_config(config, load_schema(Path(workflow.basedir) / "schemas" / "config.schema.yaml"))
except ConfigError as error:
    sys.exit(str(error))

RESULTS = "results"
LOGS = "logs"
RUN = config["run"]
DISTILL = config["distill"]
COLDSTART_DIR = f"{RESULTS}/trajectories/stage=coldstart/run={RUN}/iter=0"


def gpus_per_job(requested):
    """GPUs a GPU-stage job asks for: none when the config or the machine says CPU."""
    if config["device"] == "cpu":
        return 0
    if config["device"] == "auto" and gpu_count() == 0:
        return 0
    return requested


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
    return [f"{RESULTS}/models/tiny-{policy['tiny']['size']}-seed{policy['tiny']['seed']}"]


def table_inputs():
    """Every Parquet file the database views read: the outputs of all stages."""
    return [
        f"{RESULTS}/tasks/tasks.parquet",
        f"{RESULTS}/queries/queries.parquet",
        *coldstart_parts(),
        f"{RESULTS}/train_metrics/stage=sft/run={RUN}/part-0.parquet",
    ]


def final_targets():
    """The default targets: the database, which depends on every stage enabled in config."""
    return [f"{RESULTS}/kpipe.duckdb"]
