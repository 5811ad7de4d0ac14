"""The trajectory viewer: a static HTML folder that opens from disk (file://), no server.

``<out>/index.html`` holds the list of every trajectory (a compact JSON index: filters and
sorted views run in the browser) and the per-group counts; each trajectory's turns (prompt
summary, highlighted code, diff against the previous turn, feedback, scores) are rendered at
build time into ``<out>/data/page-NNNN.js`` files (gzipped JSON, see `pack`) that the page
loads with a ``<script>`` tag on first use (``fetch()`` of local files is blocked under
file:// in Chromium). So 10^4 trajectories open as fast as ten, and the folder is also what
the Snakemake report embeds.

The page is web files of this package: ``web/viewer.html.j2`` (a Jinja2 template, autoescaped),
``web/viewer.css`` and ``web/viewer.js``, inlined into ``index.html`` so that one file opens
from disk. Everything that came from a model or a task is escaped here (Pygments and
``html.escape``) before it reaches any HTML string; the index is JSON, inlined with ``<``, ``>``
and ``&`` escaped, that the page only writes with ``textContent``.
"""

from __future__ import annotations

import base64
import contextlib
import difflib
import gzip
import html
import itertools
import json
import logging
import math
import multiprocessing
import os
import shutil
import tempfile
import webbrowser
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import click
import duckdb
import jinja2
from markupsafe import Markup
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import PythonLexer

from kpipe.data.db import connect, locate_db

log = logging.getLogger(__name__)

STAGE_ORDER = ("coldstart", "rl", "rl_val", "eval", "budget", "stts")  # pipeline order, for the default view
TRAJECTORY_KEY = ("stage", "run", "iteration", "model", "task_id", "sample")
TRAJECTORIES_PER_FILE = 50
PROMPT_CLIP = 4000  # characters of a turn's last prompt message kept in the viewer
TEXT_CLIP = 12000  # characters of a response or feedback kept in the viewer
FETCH_ROWS = 2000
HACK_LINE = "Hacking check failed: "  # kpipe.gym.judge.feedback.build_feedback
DIFF_CLASSES = {"+": "gi", "-": "gd", "@": "gu"}  # Pygments' Generic.Inserted, .Deleted, .Subheading

# One row per turn, in trajectory order; prompts are summarised in SQL so that full
# multi-turn contexts never reach Python. Hack reasons: the `evals` row when there is one,
# else the feedback line KernelGym wrote them into.
TURNS_SQL = f"""
WITH hacks AS (
    SELECT key AS eval_key, any_value(hack_reasons) AS eval_hack_reasons FROM evals GROUP BY key
)
SELECT t.stage, t.run, t.iteration, t.model, t.task_id, t.sample, t.turn,
       list_transform(t.prompt_messages, lambda m: m.role) AS prompt_roles,
       list_transform(t.prompt_messages, lambda m: length(m.content)) AS prompt_chars,
       left(t.prompt_messages[-1].content, {PROMPT_CLIP}) AS prompt_last,
       t.prompt_tokens, t.completion_tokens, t.finish_reason,
       CASE WHEN t.code IS NULL THEN left(t.response, {TEXT_CLIP}) END AS response,
       t.code, t.status, t.correct, t.hacked, t.speedup_eager, t.speedup_compile, t.pr,
       left(t.feedback, {TEXT_CLIP}) AS feedback,
       t.reward, t.return_to_go, t.advantage, t.kept, t.rejected_by, t.gen_s, t.eval_s,
       h.eval_hack_reasons
FROM turns t
LEFT JOIN hacks h USING (eval_key)
ORDER BY coalesce(list_position({list(STAGE_ORDER)}, t.stage), 99), t.stage, t.run, t.iteration, t.model,
         t.task_id, t.sample, t.turn
"""

REFERENCES_SQL = """
SELECT task_id, name, level, reference_src FROM tasks
UNION ALL
SELECT query_id, name, level, reference_src FROM queries
WHERE query_id NOT IN (SELECT task_id FROM tasks)
"""


@dataclass(frozen=True)
class Task:
    name: str | None
    level: int | None
    reference_src: str | None


NO_TASK = Task(None, None, None)  # a trajectory whose task is in neither `tasks` nor `queries`


def json_for_html(value: Any) -> str:
    """JSON that is safe inside an HTML <script> element: no <, > or & survives."""
    text = json.dumps(value, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def finite(value: float | None) -> float | None:
    """A number JSON can carry: NaN and infinities become null."""
    return value if value is not None and math.isfinite(value) else None


def fmt_number(value: float | None) -> str:
    if value is None:
        return "—"
    return "nan" if math.isnan(value) else f"{value:.3g}"


def yes_no(flag: bool | None) -> str | None:
    return None if flag is None else ("yes" if flag else "no")


def esc(value: Any) -> str:
    return html.escape("—" if value is None else str(value))


def highlight_python(code: str) -> str:
    """Code as highlighted, escaped HTML."""
    return highlight(code, PythonLexer(), HtmlFormatter(cssclass="hl"))


def code_diff(previous: str | None, current: str | None, turn: int) -> str:
    """The unified diff (difflib) of the previous turn's code to this turn's; a sentence when there is none."""
    if previous is None or current is None:
        which = f"turn {turn - 1}" if previous is None else "this turn"
        return f'<p class="note">No diff: {which} has no extracted code.</p>'
    lines = list(difflib.unified_diff(previous.splitlines(), current.splitlines(), f"turn {turn - 1}",
                                      f"turn {turn}", lineterm=""))
    if not lines:
        return '<p class="note">Same code as the previous turn.</p>'
    return '<div class="hl"><pre>' + "\n".join(diff_line(line) for line in lines) + "</pre></div>"


def diff_line(line: str) -> str:
    """One unified-diff line, escaped, in the class Pygments' DiffLexer gives it (its stylesheet
    colours them). Not the lexer itself: it doubled the build time of 10^4 trajectories."""
    kind = "gh" if line.startswith(("--- ", "+++ ")) else DIFF_CLASSES.get(line[:1])
    text = html.escape(line)
    return f'<span class="{kind}">{text}</span>' if kind else text


def hack_reasons(row: dict[str, Any]) -> list[str]:
    if row["eval_hack_reasons"]:
        return list(row["eval_hack_reasons"])
    for line in (row["feedback"] or "").splitlines():
        if line.startswith(HACK_LINE):
            return line[len(HACK_LINE):].split("; ")
    return []


def prompt_summary(row: dict[str, Any]) -> str:
    roles = row["prompt_roles"] or []
    parts = ", ".join(f"{role} {chars:,}" for role, chars in zip(roles, row["prompt_chars"] or [], strict=True))
    tokens = f", {row['prompt_tokens']:,} tokens" if row["prompt_tokens"] is not None else ""
    return f"{len(roles)} message(s) ({parts} characters){tokens}"


def outcome_class(row: dict[str, Any]) -> str:
    """The badge colour: hacked, correct or failed (whatever KernelGym's status vocabulary)."""
    return "hacked" if row["hacked"] else ("correct" if row["correct"] else "failed")


def render_turn(row: dict[str, Any], previous_code: str | None, last: bool) -> str:
    """One turn as escaped HTML: scores, prompt summary, code, diff, feedback."""
    turn = row["turn"]
    kept = "—" if row["kept"] is None else ("kept" if row["kept"] else f"rejected ({row['rejected_by'] or '?'})")
    scores = [
        ("status", row["status"]), ("correct", yes_no(row["correct"])), ("hacked", yes_no(row["hacked"])),
        ("speedup vs eager", fmt_number(row["speedup_eager"])),
        ("speedup vs torch.compile", fmt_number(row["speedup_compile"])),
        ("PR (Triton share of time)", fmt_number(row["pr"])), ("reward", fmt_number(row["reward"])),
        ("return-to-go", fmt_number(row["return_to_go"])), ("advantage", fmt_number(row["advantage"])),
        ("training", kept), ("completion tokens", row["completion_tokens"]), ("finish reason", row["finish_reason"]),
        ("generation s", fmt_number(row["gen_s"])), ("evaluation s", fmt_number(row["eval_s"])),
    ]
    parts = [
        f'<div class="turn" id="turn-{turn}"><h3>Turn {turn} '
        f'<span class="status {outcome_class(row)}">{esc(row["status"])}</span></h3>',
        '<table class="kv">' + "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in scores) + "</table>",
    ]
    reasons = hack_reasons(row)
    if reasons:
        parts.append('<div class="hack"><b>Hack reasons</b><ul>' + "".join(f"<li>{esc(r)}</li>" for r in reasons)
                     + "</ul></div>")
    parts.append(f"<details><summary>Prompt: {esc(prompt_summary(row))}</summary>"
                 f'<p class="note">Its last message (first {PROMPT_CLIP:,} characters):</p>'
                 f'<pre class="text">{esc(row["prompt_last"] or "")}</pre></details>')
    if row["code"] is not None:
        parts.append(f'<details open><summary>Code</summary>{highlight_python(row["code"])}</details>')
    else:
        parts.append('<details open><summary>Response (no code could be extracted)</summary>'
                     f'<pre class="text">{esc(row["response"] or "")}</pre></details>')
    if turn > 1:
        parts.append(f'<details open><summary>Diff against turn {turn - 1}</summary>'
                     f'{code_diff(previous_code, row["code"], turn)}</details>')
    shown = "the episode ended here: not shown to the model" if last else "shown to the model in the next turn's prompt"
    parts.append(f'<details open><summary>Feedback ({esc(shown)})</summary>'
                 f'<pre class="text">{esc(row["feedback"] or "")}</pre></details></div>')
    return "".join(parts)


def render_trajectory(rows: list[dict[str, Any]], task: Task) -> dict[str, str]:
    """The trajectory's header and its turns as escaped HTML (the page puts the reference between)."""
    first = rows[0]
    head = (f'<h2>{esc(first["task_id"])}' + (f" — {esc(task.name)}" if task.name else "") + "</h2>"
            f'<p class="meta">stage {esc(first["stage"])} · run {esc(first["run"])} · iteration '
            f'{esc(first["iteration"])} · model {esc(first["model"])} · sample {esc(first["sample"])}'
            f' · level {esc(task.level)} · {len(rows)} turn(s)</p>')
    turns = []
    previous_code = None
    for i, row in enumerate(rows):
        turns.append(render_turn(row, previous_code, last=i == len(rows) - 1))
        previous_code = row["code"]
    return {"head": head, "turns": "".join(turns)}


@lru_cache(maxsize=1024)
def render_reference(task: Task) -> str:
    """The task's reference, highlighted once per task however many data files show it."""
    if not task.reference_src:
        return '<p class="note">No reference source in the database for this task.</p>'
    return highlight_python(task.reference_src)


def index_entry(number: int, file_number: int, rows: list[dict[str, Any]], task: Task) -> dict[str, Any]:
    """What the list, its filters and its sorted views need of one trajectory."""
    first, final = rows[0], rows[-1]
    speedups = [finite(r["speedup_eager"]) for r in rows if r["correct"] and not r["hacked"]]
    best = max((s for s in speedups if s is not None), default=None)
    changes = [(b["reward"] - a["reward"]) for a, b in itertools.pairwise(rows)
               if a["reward"] is not None and b["reward"] is not None]
    jump = max(changes, key=abs, default=None)
    return {
        "id": number, "file": file_number, "stage": first["stage"], "run": first["run"],
        "iteration": first["iteration"], "model": first["model"], "task": first["task_id"], "name": task.name,
        "sample": first["sample"], "turns": len(rows), "status": final["status"],
        "statuses": sorted({r["status"] or "none" for r in rows}), "correct": bool(final["correct"]),
        "best_speedup": best, "hacked_turns": sum(bool(r["hacked"]) for r in rows),
        "reward": finite(final["reward"]), "reward_change": finite(jump),
    }


def turn_rows(con: duckdb.DuckDBPyConnection) -> Iterator[dict[str, Any]]:
    """Every turn as a dict, streamed in trajectory order (10^4 trajectories never sit in memory)."""
    cursor = con.execute(TURNS_SQL)
    names = [column[0] for column in cursor.description]
    while batch := cursor.fetchmany(FETCH_ROWS):
        for values in batch:
            yield dict(zip(names, values, strict=True))


def trajectories(rows: Iterable[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    for _, group in itertools.groupby(rows, key=lambda row: tuple(row[k] for k in TRAJECTORY_KEY)):
        yield list(group)


def batches(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    """Consecutive lists of `size` items (itertools.batched needs Python 3.12)."""
    iterator = iter(items)
    while batch := list(itertools.islice(iterator, size)):
        yield batch


def pack(payload: dict[str, Any]) -> str:
    """JSON, gzipped and base64-encoded: highlighted HTML is ~6x its code and gzips ~8x, so 10^4
    trajectories of 3 turns take ~150 MB instead of 1.3 GB; the page unpacks with DecompressionStream."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    return base64.b64encode(gzip.compress(data, compresslevel=3, mtime=0)).decode("ascii")  # 3x faster than 6, +20%


def write_data_file(data_dir: Path, file_number: int, payload: dict[str, Any]) -> None:
    path = data_dir / f"page-{file_number:04d}.js"
    path.write_text(f'kpipeViewer.addPage({file_number},"{pack(payload)}");\n', encoding="ascii")


def group_counts(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Trajectories, turns, correct and hacked counts per (stage, run, iteration, model)."""
    groups: dict[tuple, dict[str, Any]] = {}
    for e in entries:
        key = (e["stage"], e["run"], e["iteration"], e["model"])
        g = groups.setdefault(key, {"trajectories": 0, "turns": 0, "correct": 0, "hacked": 0, "reward": 0.0})
        g["trajectories"] += 1
        g["turns"] += e["turns"]
        g["correct"] += e["correct"]
        g["hacked"] += e["hacked_turns"] > 0
        g["reward"] += e["reward"] or 0.0
    return [{"stage": k[0], "run": k[1], "iteration": k[2], "model": k[3], **g,
             "reward": g["reward"] / g["trajectories"]} for k, g in groups.items()]


def render_index(entries: list[dict[str, Any]], db_path: Path) -> str:
    """The page (web/viewer.html.j2, with its stylesheet and script inlined so it opens from file://)."""
    return page_template().render(
        entries=entries, n_turns=sum(e["turns"] for e in entries), db_path=db_path, groups=group_counts(entries),
        code_styles=Markup(HtmlFormatter(style="default").get_style_defs(".hl")),
        index=Markup(json_for_html(entries)))  # JSON inside <script>: entities would not be decoded there


@lru_cache(maxsize=1)
def page_template() -> jinja2.Template:
    """The page template; everything it is given is escaped unless it is Markup (built escaped here)."""
    env = jinja2.Environment(loader=jinja2.PackageLoader("kpipe.report", "web"), autoescape=True,
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.filters |= {"number": fmt_number, "thousands": "{:,}".format, "cell": lambda v: "—" if v is None else v}
    return env.get_template("viewer.html.j2")


def replace_dir(built: Path, out_dir: Path) -> None:
    """Put the freshly built folder in place of `out_dir` (refusing to delete a folder not ours)."""
    if out_dir.exists():
        if any(out_dir.iterdir()) and not (out_dir / "index.html").exists():
            raise FileExistsError(f"{out_dir} exists and is not a viewer folder (no index.html): not replacing it")
        shutil.rmtree(out_dir)
    os.replace(built, out_dir)


def render_file(data_dir: Path, file_number: int, first_id: int, chunk: list[list[dict[str, Any]]],
                tasks: dict[str, Task]) -> list[dict[str, Any]]:
    """Write one data file of trajectories and return their index entries (a worker's job)."""
    payload: dict[str, Any] = {"trajectories": {}, "references": {}}
    entries = []
    for offset, rows in enumerate(chunk):
        task = tasks.get(rows[0]["task_id"], NO_TASK)
        entry = index_entry(first_id + offset, file_number, rows, task)
        entries.append(entry)
        payload["trajectories"][entry["id"]] = {"task": entry["task"], **render_trajectory(rows, task)}
        if entry["task"] not in payload["references"]:
            payload["references"][entry["task"]] = render_reference(task)
    write_data_file(data_dir, file_number, payload)
    return entries


def render_files(db_path: Path, data_dir: Path, per_file: int, workers: int) -> list[dict[str, Any]]:
    """Every data file, rendered by `workers` processes while DuckDB streams the next trajectories;
    at most two files per worker wait in memory. Returns the index entries in trajectory order."""
    entries: list[dict[str, Any]] = []
    pending: deque[Future] = deque()
    # fork, not spawn: a spawned worker re-runs the __main__ module, which under Snakemake is the
    # job's script. The first task forks every worker at once, before DuckDB starts its threads.
    fork = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(workers, mp_context=fork) if workers > 1 else contextlib.nullcontext() as pool:
        if pool is not None:
            pool.submit(int).result()
        with connect(db_path) as con:
            tasks = {task_id: Task(name, level, src)
                     for task_id, name, level, src in con.execute(REFERENCES_SQL).fetchall()}
            for file_number, chunk in enumerate(batches(trajectories(turn_rows(con)), per_file)):
                needed = {rows[0]["task_id"]: tasks[rows[0]["task_id"]] for rows in chunk
                          if rows[0]["task_id"] in tasks}
                job = (data_dir, file_number, file_number * per_file, chunk, needed)
                if pool is None:
                    entries.extend(render_file(*job))
                    continue
                pending.append(pool.submit(render_file, *job))
                if len(pending) >= 2 * workers:
                    entries.extend(pending.popleft().result())
            while pending:
                entries.extend(pending.popleft().result())
    return entries


def build_viewer(db_path: Path, out_dir: Path, per_file: int = TRAJECTORIES_PER_FILE,
                 workers: int = 1) -> dict[str, int]:
    """Write the viewer for every trajectory of `db_path` to `out_dir` (index.html + data/).

    Built in a temporary sibling folder and renamed into place, so a failed build leaves the
    previous viewer intact. Returns the numbers of trajectories, turns and data files.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    built = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        built.chmod(0o755)  # mkdtemp's 0700 would hide the viewer from a web server or a colleague
        data_dir = built / "data"
        data_dir.mkdir()
        entries = render_files(db_path, data_dir, per_file, workers)
        (built / "index.html").write_text(render_index(entries, db_path), encoding="utf-8")
        n_files = len(list(data_dir.glob("page-*.js")))
        replace_dir(built, out_dir)
    except BaseException:
        shutil.rmtree(built, ignore_errors=True)
        raise
    counts = {"trajectories": len(entries), "turns": sum(e["turns"] for e in entries), "files": n_files}
    log.info("%s/index.html: %d trajectories, %d turns, %d data file(s)", out_dir, *counts.values())
    return counts


@click.command("view")
@click.option("--results", type=click.Path(file_okay=False),
              help="the folder to read (kpipe.duckdb) and write (viewer/): a run's, results/runs/<config run>+<RL runs>; "
                   "default: the one run's under ./results/runs")
@click.option("--db", "db_path", help="database path (default: $KPIPE_DB, else the folder's kpipe.duckdb)")
@click.option("--out", "out_dir", type=click.Path(file_okay=False),
              help="folder to write (index.html and data/); default: viewer/ beside the database")
@click.option("--workers", default=min(8, os.cpu_count() or 1), show_default=True,
              help="processes that render the data files")
@click.option("--open", "open_browser", is_flag=True, help="open index.html in the default browser when built")
def view_command(results: str | None, db_path: str | None, out_dir: str | None, workers: int,
                 open_browser: bool) -> None:
    """Build the static trajectory viewer from the database (opens from disk, no server)."""
    db = locate_db(db_path, results)
    out = Path(out_dir) if out_dir else db.parent / "viewer"
    counts = build_viewer(db, out, workers=workers)
    index = out.resolve() / "index.html"
    click.echo(f"{index}: {counts['trajectories']} trajectories, {counts['turns']} turns, "
               f"{counts['files']} data file(s)")
    if open_browser and not webbrowser.open(index.as_uri()):
        click.echo(f"no browser could be started here: open {index.as_uri()} yourself", err=True)

