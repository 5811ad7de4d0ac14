"""Snakemake wrapper: select the evaluation tasks from the vendored KernelBench sets."""

from kpipe.infra.jobs import snakemake_job

with snakemake_job(snakemake) as job:  # noqa: F821 (injected by Snakemake)
    from kpipe.data.ingest import build_tasks
    from kpipe.data.io import write_table

    tasks = build_tasks(job.params.kernelbench)
    write_table(tasks, job.output[0], "tasks")
    print(f"{tasks.num_rows} tasks -> {job.output[0]}")
