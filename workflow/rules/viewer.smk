# The trajectory viewer (kpipe.report.viewer.build_viewer): results/viewer/index.html and its lazily
# loaded data/ files, a static page over every trajectory of results/kpipe.duckdb that opens
# from disk; the report links it under "Trajectories". `kpipe view` builds the same outside Snakemake.


rule viewer:
    """kpipe.report.viewer.build_viewer: the static trajectory viewer."""
    input:
        db=f"{REPORT_DIR}/kpipe.duckdb",
    output:
        report(directory(f"{REPORT_DIR}/viewer"), htmlindex="index.html", caption="../report/viewer.rst",
               category="Trajectories", labels={"page": "trajectory viewer"}),
    params:
        code=job_code("viewer", "report/viewer.py", "report/web"),
    threads: 4  # processes rendering the data files (Snakemake lowers it to --cores)
    log:
        f"{REPORT_LOGS}/viewer.log",
    conda:
        "../envs/kpipe.yaml"
    script:
        "../scripts/viewer.py"
