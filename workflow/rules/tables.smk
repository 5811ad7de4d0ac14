# The paper's tables (one workflow/sql/<name>.sql each) and figures from results/kpipe.duckdb,
# all in `snakemake --report report.html`. The database's views read every stage's Parquet
# files; build_db depends on the stage outputs, so these rerun whenever a stage does.


rule tables:
    """kpipe.report.tables.build_tables: every workflow/sql/<name>.sql as Markdown and CSV."""
    input:
        db=f"{REPORT_DIR}/kpipe.duckdb",
        sql=[sql_file(name) for name in TABLE_NAMES],
        views=sql_file("views"),
        checkpoints=checkpoint_selections(),  # which RL checkpoint a best_val model is: quoted in the notes
    output:
        *report_tables(),
    params:
        n_boot=config["tables"]["n_boot"],
        report_turn=config["tables"]["report_turn"],
        own_models=own_models(),
        sql_dir=lambda wildcards, input: str(Path(input.sql[0]).parent),
        code=job_code("tables", "report/tables.py", "report/paper_numbers.py", "data/metrics.py"),
    log:
        f"{REPORT_LOGS}/tables.log",
    conda:
        "../envs/kpipe.yaml"
    script:
        "../scripts/tables.py"


rule figures:
    """kpipe.report.figures.build_figures: the paper's figures as PNG."""
    input:
        db=f"{REPORT_DIR}/kpipe.duckdb",
        sql=[sql_file(name)
             for name in ("training_curves", "stts_curves", "hacking_ratio", "rl_validation", "kevin_budget",
                          "rl_reward")],
    output:
        *[report(f"{REPORT_DIR}/figures/{name}.png", caption=f"../report/{name}.rst", category="Figures",
                 labels={"figure": name}) for name in FIGURE_NAMES],
    params:
        n_boot=config["tables"]["n_boot"],
        sql_dir=lambda wildcards, input: str(Path(input.sql[0]).parent),
        code=job_code("figures", "report/figures.py", "report/tables.py", "data/metrics.py"),
    log:
        f"{REPORT_LOGS}/figures.log",
    conda:
        "../envs/kpipe.yaml"
    script:
        "../scripts/figures.py"
