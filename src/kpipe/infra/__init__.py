"""Infrastructure at the bottom: configuration, GPU leases, launching, process hygiene, Snakemake job wrapping, code provenance."""
