"""Issue 30: the tables record which KernelGym check fired per turn and show the paper's hack definition
("no Triton kernel executed in training or evaluation mode") beside kpipe's from the same rows; the
Fast@p rows report the turn `tables.report_turn` picks (paper §6.1: baselines at their best turn)."""

import re

import pandas as pd
import pytest
from test_fastp_definition import write_fixture

from kpipe.data.db import build_db, connect
from kpipe.data.io import write_table
from kpipe.gym.judge.evaluation import hack_reasons_before_timing
from kpipe.gym.protocol import Protocol
from kpipe.report.tables import DEFAULT_SQL_DIR, best_turn, build_tables, run_table_sql, table_sql_files, turn_rule

# a candidate that launched no Triton kernel in train() mode and is otherwise clean (integrity evidence recorded)
CLEAN = {"patched": [], "hooks_intact": True, "threads": []}
PAPER_REASON = hack_reasons_before_timing({"launches": {"train": [], "eval": ["add_kernel"]}, **CLEAN}, {}, Protocol(),
                                          False)[0]
GHOST = "ghost_replay: output still correct with every Triton launch suppressed"
STATIC = "static try_except: try/except around the kernel (line 3)"
TIMED = "no_triton_launch: the timed calls launched no Triton kernel"

# (task, sample, status, hack reasons, speedup): model h, level 1, one turn
TURNS = [("t1", 0, "hacked", [PAPER_REASON, GHOST], None), ("t1", 1, "hacked", [GHOST], None),
         ("t2", 0, "hacked", [STATIC], None), ("t2", 1, "pass", [], 1.5), ("t3", 0, "hacked", [TIMED], None),
         ("t3", 1, "hacked", None, None)]  # no evals row: reasons unrecorded


@pytest.fixture
def db(tmp_path):
    write_fixture(tmp_path)
    rows = [{"run": "r", "stage": "eval", "iteration": 0, "model": "h", "task_id": task, "sample": sample, "turn": 1,
             "status": status, "correct": status == "pass", "hacked": status == "hacked", "speedup_eager": speedup,
             "speedup_compile": speedup, "reward": 0.0, "eval_key": f"{task}-{sample}" if reasons is not None else None}
            for task, sample, status, reasons, speedup in TURNS]
    evals = [{"key": f"{task}-{sample}", "status": status, "correct": status == "pass", "hacked": status == "hacked",
              "hack_reasons": reasons} for task, sample, status, reasons, _ in TURNS if reasons is not None]
    write_table(rows, tmp_path / "trajectories" / "stage=eval" / "run=h" / "part-0.parquet", "trajectories")
    write_table(evals, tmp_path / "evals" / "part-0.parquet", "evals")
    build_db(tmp_path, tmp_path / "kpipe.duckdb")
    return tmp_path / "kpipe.duckdb"


def test_kernelgyms_train_and_eval_mode_reason_is_the_papers_check(db):
    assert PAPER_REASON.startswith("no_triton_launch: no Triton kernel ran in train() mode")
    checks = run_table_sql(db, DEFAULT_SQL_DIR / "hacking_ratio.sql").query("model == 'h'")
    row = checks[checks["level"] == 1].iloc[0]
    assert (row["n_samples"], row["n_hacked"], row["n_hacked_paper"]) == (4, 3, 1)
    assert row["hacking_ratio"] == 75.0 and row["hacking_ratio_paper"] == 25.0
    assert row["checks"] == "ghost_replay=2, no_triton_launch=1, static_screen=1"
    level2 = checks[checks["level"] == 2].iloc[0]  # t3: a timed-call check and a hack without reasons
    assert level2["n_hacked_paper"] == 0 and level2["checks"] == "no_triton_launch_timed=1, unrecorded=1"


def test_fast_p_tables_show_both_definitions_from_the_same_rows(db, tmp_path):
    table = run_table_sql(db, DEFAULT_SQL_DIR / "table1_fastp_eager.sql")
    cell = table.query("model == 'h' and level == 1 and history == 'last'").iloc[0]
    assert (cell["n_hacked"], cell["n_hacked_paper"], cell["n_unjudged"]) == (3, 1, 2)
    assert cell["fast_1"] == 25.0 and cell["fast_1_paper_hi"] == 75.0  # paper's Fast@1 in [25, 75]: 2 never timed
    build_tables(db, tmp_path / "tables", n_boot=0)
    md = (tmp_path / "tables" / "table1_fastp_eager.md").read_text()
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in md.splitlines() if line.startswith("| kpipe")]
    h = {row[6]: row for row in rows if row[1] == "h"}
    assert h["kpipe"][7] == "5" and h["kpipe"][8] == "25.0"  # hacked over all levels: 3 at level 1, 2 at level 2
    assert h["paper"][7] == "1" and h["paper"][8] == "25.0–75.0"
    assert "hacks = paper" in md


def test_report_turn_is_a_stated_option_with_the_papers_rule_for_baselines(tmp_path):
    db = write_fixture(tmp_path)  # model m: turn 2 has the best mean Fast@p, turn 3 is its last
    table = run_table_sql(db, DEFAULT_SQL_DIR / "table1_fastp_eager.sql")
    assert best_turn(table[(table["model"] == "m") & (table["history"] == "last")]) == 2
    assert turn_rule("gpt-5", "paper", own_models=["drkernel"]) == "best"
    assert turn_rule("drkernel", "paper", own_models=["drkernel"]) == "last"

    def m_turn(**options) -> str:
        out = tmp_path / "t"
        build_tables(db, out, n_boot=0, **options)
        md = (out / "table1_fastp_eager.md").read_text()
        rows = [[c.strip() for c in line.strip("|").split("|")] for line in md.splitlines() if line.startswith("| kpipe")]
        return next(row[4] for row in rows if row[1] == "m")

    assert m_turn() == "2 (best of 1..3)"  # report_turn paper: m is not one of our models, a baseline
    assert m_turn(own_models=["m"]) == "3"
    assert m_turn(report_turn="last") == "3"
    with pytest.raises(ValueError, match="report_turn"):
        turn_rule("m", "first", ())
    assert pd.read_csv(tmp_path / "t" / "table1_fastp_eager.csv")["n_unjudged"].notna().any()


def _needs_paper_columns(column: str) -> list[str]:
    """The paper-definition columns a kpipe-definition column needs beside it: a Fast@p percentage its upper
    bound (`<column>_paper_hi`), a hacking ratio its paper ratio."""
    if column.startswith("hacking_ratio") and not column.endswith("_paper"):
        return [column.replace("hacking_ratio", "hacking_ratio_paper", 1)]
    if re.search(r"(^|_)fast_\d", column) and not column.startswith("n_") and not column.endswith(("_lo", "_hi")):
        return [f"{column}_paper_hi"]
    return []


def test_every_fastp_and_hacking_table_has_the_paper_definition_columns(db):
    """Issue 55: every table that reports Fast@p or a hacking ratio carries the paper's hack definition too."""
    checked = []
    for sql in table_sql_files(DEFAULT_SQL_DIR):
        columns = set(run_table_sql(db, sql).columns)
        for column in sorted(columns):
            for needed in _needs_paper_columns(column):
                assert needed in columns, f"{sql.name}: {column} without {needed}"
                checked.append(sql.stem)
    assert {"table1_fastp_eager", "table2_fastp_compile", "stts_curves", "rl_validation", "ablations",
            "kevin_metrics", "hacking_ratio", "eval_summary"} <= set(checked)


def test_the_paper_definition_reaches_rl_validation_and_figure_8(tmp_path):
    """RL validation rows (stage rl_val) count in the hacking-ratio table by both definitions (Figure 8)."""
    write_fixture(tmp_path)
    rows = [{"run": "r", "stage": "rl_val", "iteration": 4, "model": "rl-r", "task_id": task, "sample": sample, "turn": 1,
             "status": status, "correct": status == "pass", "hacked": status == "hacked", "speedup_eager": speedup,
             "speedup_compile": speedup, "reward": 0.0, "eval_key": f"{task}-{sample}"}
            for task, sample, status, reasons, speedup in TURNS if reasons is not None]
    evals = [{"key": f"{task}-{sample}", "status": status, "correct": status == "pass", "hacked": status == "hacked",
              "hack_reasons": reasons} for task, sample, status, reasons, _ in TURNS if reasons is not None]
    write_table(rows, tmp_path / "trajectories" / "stage=rl_val" / "run=r" / "part-0.parquet", "trajectories")
    write_table(evals, tmp_path / "evals" / "part-0.parquet", "evals")
    build_db(tmp_path, tmp_path / "kpipe.duckdb")
    ratio = run_table_sql(tmp_path / "kpipe.duckdb", DEFAULT_SQL_DIR / "hacking_ratio.sql").query("stage == 'rl_val'")
    level1 = ratio[ratio["level"] == 1].iloc[0]
    assert (level1["n_samples"], level1["n_hacked"], level1["n_hacked_paper"]) == (4, 3, 1)
    validation = run_table_sql(tmp_path / "kpipe.duckdb", DEFAULT_SQL_DIR / "rl_validation.sql")
    cell = validation[validation["level"] == 1].iloc[0]
    assert (cell["n_hacked"], cell["n_hacked_paper"], cell["n_unjudged"]) == (3, 1, 2)
    assert cell["fast_1"] == 25.0 and cell["fast_1_paper_hi"] == 75.0 and cell["hacking_ratio_paper"] == 25.0


def test_kernelbench_verdict_beside_kpipes_and_the_samples_its_extra_checks_change(tmp_path):
    """Issue 55: kb_correct (KernelBench's allclose alone) is kept beside kpipe's verdict; the turns kpipe's
    relative-norm and eval()-mode checks reject are listed by kb_verdict_changes and counted per table row."""
    write_fixture(tmp_path)
    # (sample, status, correct, kb_correct, diagnostic)
    cases = [(0, "pass", True, True, ""),
             (1, "mismatch", False, True, "trial 0: relative error norm 1 > 0.05 (max abs diff 0.002)"),
             (2, "mismatch", False, True, "eval() mode: max abs diff 0.5, mean abs diff 0.1 (atol=0.01, rtol=0.01)"),
             (3, "mismatch", False, False, "trial 0: max abs diff 3, mean abs diff 1 (atol=0.01, rtol=0.01)"),
             (4, "compilation_error", False, None, "SyntaxError")]
    rows = [{"run": "r", "stage": "eval", "iteration": 0, "model": "kb", "task_id": "t1", "sample": sample, "turn": 1,
             "status": status, "correct": correct, "kb_correct": kb, "hacked": False, "speedup_eager": 1.0 if correct else None,
             "reward": 0.0, "eval_key": f"kb-{sample}"} for sample, status, correct, kb, _ in cases]
    evals = [{"key": f"kb-{sample}", "status": status, "correct": correct, "kb_correct": kb, "diagnostic": diagnostic}
             for sample, status, correct, kb, diagnostic in cases]
    write_table(rows, tmp_path / "trajectories" / "stage=eval" / "run=kb" / "part-0.parquet", "trajectories")
    write_table(evals, tmp_path / "evals" / "part-0.parquet", "evals")
    db = tmp_path / "kpipe.duckdb"
    build_db(tmp_path, db)
    with connect(db) as con:
        changed = con.sql("select sample, kpipe_check from kb_verdict_changes order by sample").fetchall()
    assert changed == [(1, "relative_norm"), (2, "eval_mode")]
    summary = run_table_sql(db, DEFAULT_SQL_DIR / "eval_summary.sql").query("model == 'kb'").iloc[0]
    assert (summary["n_correct"], summary["n_kb_correct"], summary["n_kb_changed"]) == (1, 3, 2)
    assert summary["kb_correct_rate"] == 60.0 and summary["correct_rate"] == 20.0


CHALLENGE = "timing_inconsistent: a call took 9 ms on the judge's clock (fresh inputs), 3x the claimed 3 ms"
# kgym-14's rejection after timing: a timing window's output (kpipe.gym.judge.evaluation.judge_windows); no speedup recorded
WINDOW = "window_output_mismatch: call 3 of window 1: relative error 0.8 > 0.05"


def test_the_paper_definition_upper_bound_covers_extra_checks_and_keeps_timed_speedups(tmp_path):
    """Issue 64 item 6: fast_*_paper_hi is an upper bound of the paper-definition Fast@p. A sample only kpipe's
    extra correctness checks rejected (KernelBench's allclose passed) counts in it as never timed (fast); one
    rejected after timing counts at its timed speedup where KernelGym recorded one (fast at 1.0, not at 2.0),
    as never timed where it did not (its status name may change: only its reasons are read)."""
    write_fixture(tmp_path)
    # (sample, status, correct, kb_correct, hacked, hack reasons, speedup)
    cases = [(0, "pass", True, True, False, [], 1.5),
             (1, "mismatch", False, True, False, [], None),         # extra check: relative norm
             (2, "hacked", True, True, True, [CHALLENGE], 1.3),     # rejected after timing, speedup recorded
             (3, "hacked", True, True, True, [CHALLENGE], None),    # rejected after timing, none recorded
             (4, "mismatch", False, False, False, [], None),        # wrong for KernelBench too
             (5, "hacked", False, None, True, [PAPER_REASON], None),
             (6, "hacked", False, True, True, [WINDOW], None)]           # kgym-14: a window's output, after timing
    rows = [{"run": "r", "stage": "eval", "iteration": 0, "model": "x", "task_id": "t1", "sample": sample, "turn": 1,
             "status": status, "correct": correct, "kb_correct": kb, "hacked": hacked, "speedup_eager": speedup,
             "speedup_compile": speedup, "reward": 0.0, "eval_key": f"x-{sample}"}
            for sample, status, correct, kb, hacked, _, speedup in cases]
    evals = [{"key": f"x-{sample}", "status": status, "correct": correct, "kb_correct": kb, "hacked": hacked,
              "hack_reasons": reasons} for sample, status, correct, kb, hacked, reasons, _ in cases]
    write_table(rows, tmp_path / "trajectories" / "stage=eval" / "run=x" / "part-0.parquet", "trajectories")
    write_table(evals, tmp_path / "evals" / "part-0.parquet", "evals")
    db = tmp_path / "kpipe.duckdb"
    build_db(tmp_path, db)
    table = run_table_sql(db, DEFAULT_SQL_DIR / "table1_fastp_eager.sql")
    cell = table.query("model == 'x' and history == 'last'").iloc[0]
    assert cell["n_unjudged"] == 4 and cell["n_hacked_paper"] == 1
    # kpipe: sample 0 only; upper bound at 1.0: samples 0-3 and 6; at 2.0: 1, 3 and 6 (never timed), not 2 (timed 1.3)
    assert (cell["fast_1"], cell["fast_1_paper_hi"]) == pytest.approx((100 / 7, 500 / 7))
    assert (cell["fast_2"], cell["fast_2_paper_hi"]) == pytest.approx((0.0, 300 / 7))
    for p in ("1", "1_2", "1_5", "2"):
        assert cell[f"fast_{p}_paper_hi"] >= cell[f"fast_{p}"]
    summary = run_table_sql(db, DEFAULT_SQL_DIR / "eval_summary.sql").query("model == 'x'").iloc[0]
    assert summary["correct_rate_paper_hi"] == pytest.approx(500 / 7) and summary["n_unjudged"] == 4
