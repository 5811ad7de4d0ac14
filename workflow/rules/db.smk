# The DuckDB database: views over the Parquet files of the DAG, plus workflow/sql/views.sql.
# Every stage's evaluations go to KernelGym's result cache (gym.cache), not to Parquet: export_evals
# writes the cache out as the `evals` table once every stage that evaluates has finished.

import os

from kpipe.report.tables import table_sql_files

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


# Tables and figures (rules/tables.smk)
# relative to the working directory, as every other path of the DAG: a moved tree reruns nothing
SQL_DIR = Path(os.path.relpath(Path(workflow.current_basedir).parent / "sql"))


def sql_file(name):
    """workflow/sql/<name>.sql, as a path relative to the working directory."""
    return str(SQL_DIR / f"{name}.sql")
TABLE_NAMES = [path.stem for path in table_sql_files(SQL_DIR)]


rule export_evals:
    """kpipe.gym.cache.export_evals: the KernelGym result cache (gym.cache) as the evals table."""
    input:
        trajectory_parts(),
    output:
        EVALS_EXPORT,
    params:
        cache=config["gym"]["cache"],
        code=job_code("export_evals", "gym/cache.py", "gym/result.py", "data/io.py", "data/schemas.py"),
    log:
        f"{LOGS}/export_evals.log",
    conda:
        "../envs/kpipe.yaml"
    script:
        "../scripts/export_evals.py"


rule build_db:
    """kpipe.data.db.build_db: results/kpipe.duckdb, views over every table's Parquet files."""
    input:
        **table_files(),
        views=sql_file("views"),
    output:
        # a plain output: Snakemake deletes it before the job, so after a failed build there is no
        # database and the next run builds again (never "Nothing to be done" over an old one); each good
        # build is also copied to kpipe.last-good.duckdb beside it (kpipe.data.db.build_db)
        f"{RESULTS}/kpipe.duckdb",
    params:
        # the views name their files by absolute path (any DuckDB client opens the database from any
        # directory): a moved or copied results tree rebuilds it, and what reads it
        results=os.path.abspath(RESULTS),
        code=job_code("build_db", "data/db.py", "data/schemas.py", "data/io.py"),
    log:
        f"{LOGS}/build_db.log",
    conda:
        "../envs/kpipe.yaml"
    script:
        "../scripts/build_db.py"
