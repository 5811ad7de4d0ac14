"""Snakemake wrapper: the released cold-start trajectories as this run's coldstart stage."""

from kpipe.infra.jobs import snakemake_job

with snakemake_job(snakemake) as job:  # noqa: F821 (injected by Snakemake)
    from kpipe.agent.distill import released_coldstart_rows
    from kpipe.data.io import write_table

    rows = released_coldstart_rows(job.input[0], run=job.params.run)
    write_table(rows, job.output[0], "trajectories")
    print(f"{len(rows)} released cold-start turns -> {job.output[0]}")
