# Shared helpers: config validation, code versions, GPU counts, target lists.
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


def gpus_per_job(requested):
    """GPUs a GPU-stage job asks for: none when the config or the machine says CPU."""
    if config["device"] == "cpu":
        return 0
    if config["device"] == "auto" and gpu_count() == 0:
        return 0
    return requested


def query_sources():
    return {source["name"]: source for source in config["queries"]["sources"]}


def final_targets():
    """The default targets: the database, which depends on every stage enabled in config."""
    return [f"{RESULTS}/kpipe.duckdb"]
