"""Rule decontaminate -> kpipe.data.ingest.decontaminate_job: drop or flag training queries that
(nearly) duplicate an evaluation task."""

from kpipe.infra.jobs import snakemake_job

with snakemake_job(snakemake) as job:  # noqa: F821 (injected by Snakemake)
    from kpipe.data.ingest import decontaminate_job

    decontaminate_job(job.input.tasks, job.input.queries, job.output.queries, job.output.counts,
                      job.params.decontamination)
