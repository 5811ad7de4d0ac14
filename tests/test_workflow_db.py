"""The database stage in real Snakemake runs over a stand-in results tree: every output of the
default DAG exists (empty tables of the right schemas, empty model folders) and Snakemake holds
it up to date (`--touch`), so build_db and the planning run for real in seconds."""

import json
import re
from concurrent.futures import ThreadPoolExecutor
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kpipe.data.io import write_table
from kpipe.data.schemas import TABLES

pytestmark = pytest.mark.slow

REPORT = "results/runs/default+default"  # the default config's database, tables, figures (rules/inputs.smk)
DB = f"{REPORT}/kpipe.duckdb"
STTS_PART = "results/trajectories/stage=stts/run=default/model=tiny-rl/strategy=top_w/level=2/part-0.parquet"


def snakemake(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snakemake", "--cores", "2", *args], cwd=workdir,
                          capture_output=True, text=True)


def ok(result: subprocess.CompletedProcess) -> str:
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    return output


def query(db: Path, sql: str, cwd: Path = Path("/")) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kpipe.cli", "query", "--db", str(db), "--format", "json", sql],
                          capture_output=True, text=True, cwd=cwd)


def stand_in_outputs(workdir: Path) -> None:
    """Create every output the default DAG declares (its --summary), then let Snakemake record them."""
    summary = ok(snakemake(workdir, "--summary"))
    for line in summary.splitlines():
        path = line.split("\t")[0]
        if not path.startswith("results/") or path == DB:
            continue
        target = workdir / path
        table = next((part for part in Path(path).parts[1:] if part in TABLES), None)
        if target.suffix == "":
            target.mkdir(parents=True, exist_ok=True)
        elif target.suffix == ".parquet" and table in TABLES:
            write_table([], target, table)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.touch()


@pytest.fixture(scope="module")
def built_tree(tmp_path_factory: pytest.TempPathFactory, workflow_copy: Path) -> tuple[Path, Path]:
    """The workflow with a complete, up-to-date stand-in results tree and a real database, built
    once per module (four Snakemake runs) at `tree`, and a pristine copy of it; each test gets the
    pristine copy put back at `tree`: the database's views name their files by absolute path, so
    the tree is up to date only there (a moved tree rebuilds the database)."""
    root = tmp_path_factory.mktemp("built")
    work = root / "tree"
    work.mkdir()
    for name in ("workflow", "config"):
        shutil.copytree(workflow_copy / name, work / name)
    stand_in_outputs(work)
    ok(snakemake(work, "--touch"))
    ok(snakemake(work, DB))
    ok(snakemake(work, "--touch"))
    shutil.copytree(work, root / "pristine", symlinks=True)
    return root / "pristine", work


@pytest.fixture
def tree(built_tree: tuple[Path, Path]) -> Path:
    """The built tree as it was built, at the place it was built (modification times and
    Snakemake's records kept), up to date."""
    pristine, work = built_tree
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(pristine, work, symlinks=True)
    assert "Nothing to be done" in ok(snakemake(work, "-n"))
    return work


def test_a_deleted_declared_output_is_rebuilt(tree):
    """An interrupted job's output, deleted by Snakemake, is planned again with what reads it."""
    (tree / STTS_PART).unlink()
    output = ok(snakemake(tree, "-n"))
    assert "Nothing to be done" not in output
    assert "rule stts:" in output and "rule build_db:" in output


def test_views_read_only_the_declared_files(tree):
    """A file left on disk by other settings (here an STTS strategy no longer configured) is not read."""
    stale = tree / STTS_PART.replace("strategy=top_w", "strategy=best_window")
    write_table([{"run": "default", "stage": "stts", "task_id": "x", "turn": 1}], stale, "trajectories")
    ok(snakemake(tree, DB, "--forcerun", "build_db"))
    result = query(tree / DB, "select count(*) as n from trajectories")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [{"n": 0}]


def test_a_failed_build_is_never_forgotten_and_the_last_good_database_stays_beside(tree):
    """build_db fails naming the file and leaves no database (the last good one stays beside it), so a
    plain rerun builds again, or fails again, never "Nothing to be done" over an old database; once the
    file is repaired, the rerun's database holds its rows."""
    damaged = tree / STTS_PART
    damaged.write_bytes(damaged.read_bytes()[:40])  # truncated
    result = snakemake(tree, DB)
    assert result.returncode != 0
    log = (tree / "logs" / "runs" / "default+default" / "build_db.log").read_text()
    assert STTS_PART in log and "not a readable Parquet file" in log
    assert not (tree / DB).exists()
    tasks = query(tree / REPORT / "kpipe.last-good.duckdb", "select count(*) as n from tasks")
    assert tasks.returncode == 0, tasks.stderr
    assert json.loads(tasks.stdout) == [{"n": 0}]
    missing = query(tree / DB, "select 1")
    assert missing.returncode != 0 and "the last good database is" in missing.stderr
    assert "rule build_db:" in ok(snakemake(tree, "-n"))
    again = snakemake(tree, DB)
    assert again.returncode != 0 and "Nothing to be done" not in again.stdout + again.stderr
    write_table([{"run": "default", "stage": "stts", "task_id": "x", "turn": 1}], damaged, "trajectories")
    ok(snakemake(tree, DB))
    rows = query(tree / DB, "select count(*) as n from trajectories")
    assert json.loads(rows.stdout) == [{"n": 1}]
    assert "Nothing to be done" in ok(snakemake(tree, DB, "-n"))


def test_a_moved_tree_rebuilds_only_the_database_and_its_readers(tree, tmp_path):
    """The views name their files by absolute path, so a moved tree rebuilds the database (the rule's
    `results` param) and what reads it, and no stage; until then `kpipe query` refuses the old
    database rather than reading the old place's files. `kpipe query` without --db reads ./results."""
    moved = tmp_path / "moved"
    shutil.move(tree, moved)
    planned = planned_counts(ok(snakemake(moved, "-n")))
    assert set(planned) == {"build_db", "tables", "figures", "viewer", "all"}, planned
    stale = query(moved / DB, "select 1")
    assert stale.returncode != 0 and f"was built for {tree / REPORT}; rebuild it here" in stale.stderr
    ok(snakemake(moved, DB))
    result = subprocess.run([sys.executable, "-m", "kpipe.cli", "query", "--format", "json",
                             "select count(*) as n from trajectories"], capture_output=True, text=True, cwd=moved)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [{"n": 0}]
    elsewhere = subprocess.run([sys.executable, "-m", "kpipe.cli", "query", "--results", str(moved / REPORT),
                                "select 1"], capture_output=True, text=True, cwd="/")
    assert elsewhere.returncode == 0, elsewhere.stderr


@pytest.mark.parametrize("with_records", [True, False])
def test_results_copied_into_a_fresh_clone_rerun_only_the_database_and_its_readers(tree, tmp_path, with_records):
    """A fresh clone's files are all new (its scripts and SQL newer than every result): the copied
    results/ (times kept; with Snakemake's records in .snakemake/ or without) reruns the database
    (its views name absolute paths) and what reads it, no stage."""
    clone = tmp_path / "clone"
    for name in ("workflow", "config"):
        shutil.copytree(tree / name, clone / name, copy_function=shutil.copy)  # new modification times
    shutil.copytree(tree / "results", clone / "results", symlinks=True)
    if with_records:
        shutil.copytree(tree / ".snakemake", clone / ".snakemake", symlinks=True)
    planned = planned_counts(ok(snakemake(clone, "-n")))
    assert set(planned) == {"build_db", "tables", "figures", "viewer", "all"}, planned


def test_an_edited_script_reruns_its_rule(tree):
    """Each rule's `code` param hashes its script too, by syntax tree (the profile's triggers leave
    Snakemake's mtime-based `code` trigger off): a comment reruns nothing, a statement reruns it."""
    script = tree / "workflow" / "scripts" / "export_evals.py"
    script.write_text(script.read_text() + "\n# edited\n")
    assert "Nothing to be done" in ok(snakemake(tree, "-n"))
    script.write_text(script.read_text() + "EDITED = True\n")
    output = ok(snakemake(tree, "-n"))
    assert "rule export_evals:" in output and "Params have changed" in output


def test_plain_duckdb_opens_the_database_from_the_root_and_from_elsewhere(tree, tmp_path):
    """The README's one-liner, with no kpipe: the views' files resolve from any working directory."""
    for cwd, path in ((tree, DB), (tmp_path, str(tree / DB))):
        opened = subprocess.run([sys.executable, "-c", f"import duckdb; duckdb.connect({path!r}, read_only=True)"
                                 ".sql('select count(*) from trajectories').show()"], capture_output=True, text=True,
                                cwd=cwd)
        assert opened.returncode == 0, opened.stderr
        assert "count_star()" in opened.stdout


def test_columns_carry_their_meaning(tree):
    """DuckDB shows each column's meaning from kpipe.data.schemas (DESCRIBE-able via duckdb_columns())."""
    result = query(tree / DB, "select column_name, comment from duckdb_columns() "
                              "where table_name = 'trajectories' and column_name = 'eval_key'")
    assert json.loads(result.stdout) == [{"column_name": "eval_key", "comment": "join key into evals.key"}]


def test_released_teacher_without_its_file_stops(tree):
    """`distill.teacher: released` with a missing released_path fails, even where an earlier run's
    cold-start file would satisfy the rule."""
    result = snakemake(tree, "-n", "--config", 'distill={"teacher": "released", "released_path": "nowhere.parquet"}')
    assert result.returncode != 0
    assert "config error: distill.released_path: 'nowhere.parquet' does not exist" in result.stdout + result.stderr


def test_nested_config_overrides_take_numbers_and_range_errors_say_range(workflow_copy):
    """`--config section='{...}'`: Snakemake reads the nested values as strings; they are read as YAML."""
    planned = snakemake(workflow_copy, "-n", "--config", 'kernelbench={"size_cap": 128}', 'rl={"iterations": 2}')
    output = ok(planned)
    assert "rl_iter" in output and "config error" not in output
    bad = snakemake(workflow_copy, "-n", "--config", 'rl={"iterations": -2}')
    assert bad.returncode != 0
    assert "config error: rl.iterations: out of range: -2 is less than the minimum of 1" in bad.stdout + bad.stderr


def test_an_undefined_model_under_a_stage_stops_with_one_line_naming_the_key(workflow_copy):
    result = snakemake(workflow_copy, "-n", "--config", 'stts={"models": ["tiny-sft", "nope"]}')
    assert result.returncode != 0
    errors = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("config error")]
    assert errors == ["config error: stts.models: 'nope' not defined under models: (defined: tiny-sft, tiny-rl, teacher)"]
    assert "Traceback" not in result.stdout + result.stderr


def planned_counts(output: str) -> dict[str, int]:
    """Rule name -> planned jobs, from a dry run's 'Job stats' table."""
    stats = output.split("Job stats:")[1].split("total")[0]
    return {match.group(1): int(match.group(2)) for match in re.finditer(r"^(\w+)\s+(\d+)$", stats, re.M)}


def test_configfile_layers_over_the_default_config(workflow_copy):
    """`--configfile` merges over config/config.yaml, as over any workflow's `configfile:`: a
    partial overlay plans, and one that sets `queries.sources` keeps config.yaml's other values
    (its 5 RL iterations, not the schema's 2)."""
    partial = workflow_copy / "partial.yaml"
    partial.write_text("rl: {lr: 1.0e-3}\n")
    sources = workflow_copy / "sources.yaml"
    sources.write_text("queries:\n  sources:\n    - {name: kb, kind: kernelbench, levels: [1]}\n")
    for overlay in (partial, sources):
        assert planned_counts(ok(snakemake(workflow_copy, "-n", "--configfile", overlay.name)))["rl_iter"] == 5


def test_until_works_for_every_rule(workflow_copy):
    """`--until RULE` plans for every rule, rl_iter included (its iterations chain: kpipe/infra/snakemake_adapter.py)."""
    listed = ok(snakemake(workflow_copy, "--list-rules"))
    rules = [line.split()[0] for line in listed.splitlines() if line and not line.startswith("Using ")]
    assert "rl_iter" in rules
    with ThreadPoolExecutor(max_workers=2) as plans:  # dry runs, each mostly its interpreter's start
        outputs = dict(zip(rules, plans.map(lambda rule: ok(snakemake(workflow_copy, "-n", "--until", rule)), rules)))
    for rule, output in outputs.items():
        assert "BUG" not in output, rule
    assert planned_counts(outputs["rl_iter"])["rl_iter"] == 5


def test_until_rl_iter_runs_every_iteration(tree):
    """A real scheduler run (`--touch`: jobs mark their outputs done) of `--until rl_iter` runs all 5
    iterations and nothing after them."""
    output = ok(snakemake(tree, "--touch", "--forcerun", "rl_iter", "--until", "rl_iter"))
    assert "BUG" not in output
    assert output.count("rule rl_iter:") == 5 and "rule rl_validate:" not in output
