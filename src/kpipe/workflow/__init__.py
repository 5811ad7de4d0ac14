"""What the Snakefile calls beyond config and paths: the run's services (`kpipe.workflow.services`)."""
