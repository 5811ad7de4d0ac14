"""Snakemake wrapper: load one training-query source into the queries schema."""

from kpipe.infra.jobs import snakemake_job

with snakemake_job(snakemake) as job:  # noqa: F821 (injected by Snakemake)
    from kpipe.data.ingest import load_source
    from kpipe.data.io import write_table

    queries = load_source(job.params.source)
    write_table(queries, job.output[0], "queries")
    print(f"{queries.num_rows} queries from {job.wildcards.source} -> {job.output[0]}")
