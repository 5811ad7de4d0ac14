"""Snakemake wrapper: drop or flag training queries that (nearly) duplicate an evaluation task."""

import json

from kpipe.infra.jobs import snakemake_job

with snakemake_job(snakemake) as job:  # noqa: F821 (injected by Snakemake)
    import pyarrow as pa

    from kpipe.data.decontam import decontaminate
    from kpipe.data.io import read_table, write_table

    tasks = read_table(job.input.tasks, "tasks")
    queries = pa.concat_tables([read_table(path, "queries") for path in job.input.queries])
    cfg = job.params.decontamination
    kept, counts = decontaminate(queries, tasks, mode=cfg["mode"], threshold=cfg["threshold"])
    write_table(kept, job.output.queries, "queries")
    with open(job.output.counts, "w") as handle:
        json.dump(counts, handle, indent=2)
    print(f"decontamination ({cfg['mode']}, threshold {cfg['threshold']}): {counts}")
