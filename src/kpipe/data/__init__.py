"""Task and query sources, their normalised schema, decontamination and Parquet I/O."""
