# The DuckDB database: views over every table's Parquet files, plus workflow/sql/views.sql.


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
