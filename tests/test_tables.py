"""results/tables/*.md and .csv from the hand-made fixture: keys and counts for tracing, the
paper's reference rows, bootstrap intervals, the convention in the header."""

import pandas as pd
import pytest
from click.testing import CliRunner
from test_fastp_definition import write_fixture

from kpipe.report.paper_numbers import TABLE1_EAGER, TABLE2_COMPILE
from kpipe.report.tables import DEFAULT_SQL_DIR, build_tables, table_sql_files
from kpipe.report.cli import tables

REPO_REPORT = DEFAULT_SQL_DIR.parent / "report"


@pytest.fixture
def built(tmp_path):
    db = write_fixture(tmp_path)
    out = tmp_path / "tables"
    return db, out, build_tables(db, out, n_boot=200, own_models=("m", "single"))  # both the pipeline's own


def test_every_sql_file_gives_csv_and_markdown(built):
    _, out, written = built
    names = {p.stem for p in table_sql_files()}
    assert {"table1_fastp_eager", "table2_fastp_compile", "hacking_ratio", "training_curves", "stts_curves",
            "ablations", "eval_summary", "kevin_metrics"} <= names
    assert set(written) == names
    for name in names:
        assert (out / f"{name}.csv").exists() and (out / f"{name}.md").read_text().startswith("# ")


def test_fast_table_csv_traces_cells_and_carries_paper_rows(built):
    _, out, _ = built
    csv = pd.read_csv(out / "table1_fastp_eager.csv")
    ours = csv[csv["source"] == "kpipe"]
    for key in ["run", "model", "level", "baseline", "turn", "history", "n_samples", "n_fast_1_2"]:
        assert ours[key].notna().all(), key
    at = (ours["model"] == "m") & (ours["level"] == 1) & (ours["turn"] == 3) & (ours["history"] == "best")
    cell = ours[at].iloc[0]
    assert cell["fast_1_2"] == 75.0 and cell["n_fast_1_2"] == 3
    assert cell["fast_1_2_lo"] <= 75.0 <= cell["fast_1_2_hi"]  # task-bootstrap interval around the estimate
    paper = csv[csv["source"] == "paper"]
    assert len(paper) == 3 * len(TABLE1_EAGER)
    gpt5 = paper[(paper["model"] == "GPT-5") & (paper["level"] == 2)].iloc[0]
    assert gpt5[["fast_1", "fast_1_2", "fast_1_5", "fast_2"]].tolist() == [46.7, 28.6, 13.1, 3.0]
    compile_paper = pd.read_csv(out / "table2_fastp_compile.csv").query("source == 'paper'")
    assert len(compile_paper) == 3 * len(TABLE2_COMPILE)


def test_markdown_states_the_convention_and_shows_last_turn_and_dagger(built):
    _, out, _ = built
    md = (out / "table1_fastp_eager.md").read_text()
    assert "speedup >= p" in md and "hacked counts" in md
    assert "The paper's rows (source = paper): 8 samples per task, 3 turns, turn 3 reported" in md
    lines = [line for line in md.splitlines() if line.startswith("| kpipe")]
    assert len(lines) == 8  # models m and single, at their last turn and best of history (†), both hack definitions
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    m_last = next(row for row in cells if row[1] == "m")
    assert m_last[4] == "3" and m_last[6] == "kpipe" and m_last[8] == "50.0"  # model m, turn 3, level 1 Fast@1
    assert next(row for row in cells if row[1] == "m †")[4] == "1..3"
    paper = [row[1] for row in ([c.strip() for c in line.strip("|").split("|")] for line in md.splitlines()
                                if line.startswith("| paper"))]
    assert "GPT-5" in paper and "Dr. Kernel-14B-STTS †" in paper


def test_paper_rows_for_hacking_and_stts(built):
    _, out, _ = built
    hacking = pd.read_csv(out / "hacking_ratio.csv")
    assert set(hacking["source"]) == {"kpipe", "paper"}
    paper = hacking.query("source == 'paper' and level == 1 and model == 'Dr. Kernel-14B'")
    assert paper["hacking_ratio"].item() == 1.7
    assert "No rows yet" in (out / "stts_curves.md").read_text()  # no STTS in the fixture, said plainly


def test_cli_build(tmp_path):
    db = write_fixture(tmp_path)
    result = CliRunner().invoke(tables, ["build", "--db", str(db), "--out", str(tmp_path / "t"), "--n-boot", "0"])
    assert result.exit_code == 0, result.output
    assert "table1_fastp_eager" in result.output
    missing = CliRunner().invoke(tables, ["build", "--db", str(tmp_path / "none.duckdb")])
    assert missing.exit_code == 1 and "no database" in missing.output


def test_every_table_and_figure_has_a_report_caption():
    from kpipe.report.figures import FIGURE_NAMES

    captions = REPO_REPORT.glob("*.rst")
    names = {p.stem for p in captions}
    assert {p.stem for p in table_sql_files()} <= names
    assert set(FIGURE_NAMES) <= names


def stts_rows(model, speeds):
    """STTS rows of `model` ("<model>@<strategy>"), level-1 task t1, one sample: turn t at speeds[t - 1] (0: mismatch)."""
    return [{"run": "r", "stage": "stts", "iteration": 0, "model": model, "task_id": "t1", "sample": 0, "turn": turn,
             "status": "pass" if speed else "mismatch", "correct": bool(speed), "hacked": False,
             "speedup_eager": speed or None, "speedup_compile": speed or None, "reward": 0.0}
            for turn, speed in enumerate(speeds, start=1)]


def test_table1_has_the_stts_rows_with_every_fast_p(tmp_path):
    """Table 1's DR. KERNEL-14B-STTS rows: context management (top_w) at its last turn T and (†) the best of 1..T, with
    Fast@1.5 and Fast@2 as well; the other strategies stay in the STTS curves only, which have every Fast@p too."""
    extra = stts_rows("m@top_w(w=4)", [1.3, 2.5, 0, 1.6]) + stts_rows("m@full", [3.0, 3.0, 3.0, 3.0])
    db = write_fixture(tmp_path, extra)
    out = tmp_path / "tables"
    build_tables(db, out, n_boot=50, own_models=("m", "single"))
    csv = pd.read_csv(out / "table1_fastp_eager.csv").query("source == 'kpipe'")
    stts = csv[csv["model"] == "m@top_w(w=4)"].set_index(["history", "turn"])
    assert not (csv["model"] == "m@full").any()
    assert stts.loc[("last", 4), ["fast_1", "fast_1_2", "fast_1_5", "fast_2"]].tolist() == [100.0, 100.0, 100.0, 0.0]
    assert stts.loc[("best", 4), ["fast_1_5", "fast_2"]].tolist() == [100.0, 100.0]
    assert stts.loc[("best", 4), "fast_2_lo"] <= 100.0 <= stts.loc[("best", 4), "fast_2_hi"]
    md = (out / "table1_fastp_eager.md").read_text()
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in md.splitlines() if line.startswith("| kpipe")]
    last = next(row for row in rows if row[1] == "m@top_w(w=4)" and row[6] == "kpipe")
    dagger = next(row for row in rows if row[1] == "m@top_w(w=4) †" and row[6] == "kpipe")
    assert last[4] == "4" and last[8:12] == ["100.0", "100.0", "100.0", "0.0"]  # turn T = 4, level 1 Fast@1..@2
    assert dagger[4] == "1..4" and dagger[10:12] == ["100.0", "100.0"]
    assert "context management at its last turn T" in md
    assert not (pd.read_csv(out / "table2_fastp_compile.csv").query("source == 'kpipe'")["model"].str.contains("@")).any()

    curves = pd.read_csv(out / "stts_curves.csv")
    ours = curves.query("source == 'kpipe' and strategy == 'top_w(w=4)' and history == 'last'").set_index("T")
    assert ours.loc[4, ["fast_1_5", "fast_2", "fast_1_5_paper_hi", "fast_2_paper_hi"]].tolist() == [100.0, 0.0, 100.0, 0.0]
    assert {"fast_1_5_lo", "fast_2_hi"} <= set(curves.columns)
    paper = curves.query("source == 'paper' and level == 2 and history == 'best'")
    assert paper[["fast_1", "fast_1_2", "fast_1_5", "fast_2"]].iloc[0].tolist() == [80.9, 47.8, 23.6, 12.5]
