# The DuckDB database: views over every table's Parquet files, plus workflow/sql/views.sql.
# Every stage's evaluations go to KernelGym's result cache (gym.cache), not to Parquet: export_evals
# writes the cache out as the `evals` table once every stage that evaluates has finished.


rule export_evals:
    """kpipe.gym.cache.export_evals: the KernelGym result cache (gym.cache) as the evals table."""
    input:
        trajectory_parts(),
    output:
        EVALS_EXPORT,
    params:
        cache=config["gym"]["cache"],
        code=code_version("gym/cache.py", "gym/result.py", "data/io.py", "data/schemas.py"),
    log:
        f"{LOGS}/export_evals.log",
    conda:
        "../envs/kpipe.yaml"
    script:
        "../scripts/export_evals.py"


rule build_db:
    """kpipe.data.db.build_db: results/kpipe.duckdb, views over every table's Parquet files."""
    input:
        table_inputs(),
        views=workflow.source_path("../sql/views.sql"),
    output:
        f"{RESULTS}/kpipe.duckdb",
    params:
        code=code_version("data/db.py", "data/schemas.py"),
    log:
        f"{LOGS}/build_db.log",
    conda:
        "../envs/kpipe.yaml"
    script:
        "../scripts/build_db.py"
