"""Snakemake wrapper: the KernelGym result cache (gym.cache) as results/evals/gym_cache.parquet."""

from kpipe.infra.jobs import snakemake_job

with snakemake_job(snakemake) as job:  # noqa: F821 (injected by Snakemake)
    from kpipe.gym.cache import export_evals

    rows = export_evals(job.params.cache, job.output[0])
    print(f"wrote {job.output[0]}: {rows} evaluations from the result cache {job.params.cache}")
