# The DuckDB database: views over the Parquet files of the DAG, plus workflow/sql/views.sql.
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
        **table_files(),
        views=sql_file("views"),
    output:
        # update(): Snakemake neither deletes the database before the job nor keeps a failed job's
        # one (it restores its backup), so a damaged Parquet file never costs the previous database
        update(f"{RESULTS}/kpipe.duckdb"),
    params:
        code=code_version("data/db.py", "data/schemas.py", "data/io.py"),
    log:
        f"{LOGS}/build_db.log",
    conda:
        "../envs/kpipe.yaml"
    script:
        "../scripts/build_db.py"
