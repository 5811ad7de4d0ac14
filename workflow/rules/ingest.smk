# Ingest: evaluation tasks from the vendored KernelBench sets, training queries from their
# sources, then decontamination of the queries against the evaluation tasks.


rule ingest_tasks:
    """kpipe.data.ingest.ingest_tasks_job: the evaluation tasks from the vendored KernelBench sets."""
    output:
        TASKS,
    params:
        kernelbench=config["kernelbench"],
        code=job_code("ingest_tasks", "data"),
    priority: CRITICAL_PATH
    log:
        f"{LOGS}/ingest_tasks-{TASKS_KEY}.log",
    conda:
        "../envs/kpipe.yaml"
    script:
        "../scripts/ingest_tasks.py"


rule ingest_queries:
    """kpipe.data.ingest.ingest_queries_job: one training-query source in the queries schema."""
    output:
        f"{RESULTS}/queries_raw/source={{source}}/key={{key}}/part-0.parquet",
    params:
        source=lambda wildcards: query_sources()[wildcards.source],
        code=job_code("ingest_queries", "data"),
    priority: CRITICAL_PATH
    log:
        f"{LOGS}/ingest_queries/{{source}}-{{key}}.log",
    wildcard_constraints:
        source="[A-Za-z0-9_-]+",
        key="[0-9a-f]+",
    conda:
        "../envs/kpipe.yaml"
    script:
        "../scripts/ingest_queries.py"


rule decontaminate:
    """kpipe.data.ingest.decontaminate_job: queries that (nearly) repeat a task dropped or flagged."""
    input:
        tasks=TASKS,
        queries=raw_query_parts(),
    output:
        queries=QUERIES,
        counts=f"{RESULTS}/reports/decontamination-{QUERIES_KEY}.json",
    params:
        decontamination=config["queries"]["decontamination"],
        code=job_code("decontaminate", "data"),
    priority: CRITICAL_PATH
    log:
        f"{LOGS}/decontaminate-{QUERIES_KEY}.log",
    conda:
        "../envs/kpipe.yaml"
    script:
        "../scripts/decontaminate.py"
