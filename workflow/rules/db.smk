# The DuckDB database: views over the Parquet files of the DAG, plus workflow/sql/views.sql.
# Every stage's evaluations go to KernelGym's result cache (gym.cache), not to Parquet: export_evals
# writes the cache out as the `evals` table once every stage that evaluates has finished.


rule export_evals:
    """kpipe.gym.serve.cache.export_evals: the KernelGym result cache (gym.cache) as the evals table."""
    input:
        trajectory_parts(),
    output:
        EVALS_EXPORT,
    params:
        cache=config["gym"]["cache"],
        code=job_code("export_evals", "gym/serve/cache.py", "gym/judge/result.py", "data/io.py", "data/schemas.py"),
    log:
        f"{REPORT_LOGS}/export_evals.log",
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
        f"{REPORT_DIR}/kpipe.duckdb",
    params:
        # the views name their files by absolute path (any DuckDB client opens the database from any
        # directory): a moved or copied results tree rebuilds it, and what reads it
        results=os.path.abspath(RESULTS),
        code=job_code("build_db", "data/db.py", "data/schemas.py", "data/io.py"),
    log:
        f"{REPORT_LOGS}/build_db.log",
    conda:
        "../envs/kpipe.yaml"
    script:
        "../scripts/build_db.py"
