"""The static trajectory viewer, built from a small database of rows in the real schemas."""

import base64
import gzip
import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from kpipe.data.io import write_table
from kpipe.data.db import build_db
from kpipe.report.viewer import build_viewer, view_command

REFERENCE = "import torch\n\nclass Model(torch.nn.Module):\n    def forward(self, x):\n        return torch.relu(x)\n"
FIRST_CODE = "import triton\n\nclass ModelNew:\n    def forward(self, x):\n        return x.clamp(min=0)\n"
SECOND_CODE = "import triton\n\nclass ModelNew:\n    def forward(self, x):\n        return relu_kernel(x)\n"
ATTACK = "<script>alert(1)</script>"
DOM_SCRIPT = Path(__file__).parent / "fixtures" / "viewer" / "dom.js"
DRIVER = Path(__file__).parent / "fixtures" / "viewer" / "drive.js"
# first thing in <head>: every error the page's script throws, synchronously or in a promise
CATCH_ERRORS = ('<script>window.kpipeTestErrors = [];'
                'addEventListener("error", (e) => kpipeTestErrors.push(e.message));'
                'addEventListener("unhandledrejection", (e) => kpipeTestErrors.push(String(e.reason)));</script>')
needs_node = pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")


def turn(stage: str, task_id: str, sample: int, number: int, **fields) -> dict:
    row = {
        "run": "default", "stage": stage, "iteration": 0, "task_id": task_id, "sample": sample, "turn": number,
        "model": "tiny", "prompt_messages": [{"role": "system", "content": "You write Triton."},
                                              {"role": "user", "content": f"Optimise this (turn {number})"}],
        "response": "", "finish_reason": "stop", "code": None, "prompt_tokens": 120, "completion_tokens": 80,
        "status": "format_error", "correct": False, "hacked": False, "speedup_eager": None, "speedup_compile": None,
        "pr": None, "feedback": "Status: format_error", "reward": 0.0,
    }
    return row | fields


@pytest.fixture
def database(tmp_path) -> Path:
    """Three trajectories (7 turns): an improving eval one, a hacked RL one, a format error with a <script>."""
    results = tmp_path / "results"
    write_table([{"task_id": "kb-main-L1-19", "source": "kernelbench", "version": "main", "size_profile": "tiny",
                  "split": "eval", "level": 1, "problem_id": 19, "name": "19_ReLU", "reference_src": REFERENCE,
                  "reference_hash": "h"}], results / "tasks" / "tasks.parquet", "tasks")
    write_table([{"query_id": "drkernel_rl-7", "source": "drkernel_rl", "source_id": "7", "level": None,
                  "name": "gelu query", "reference_src": REFERENCE.replace("relu", "gelu"), "reference_hash": "q",
                  "contaminated": False, "contaminated_with": None, "similarity": 0.1}],
                results / "queries" / "queries.parquet", "queries")
    evaluation = [
        turn("eval", "kb-main-L1-19", 0, 1, code=FIRST_CODE, status="pass", correct=True, speedup_eager=0.8,
             speedup_compile=0.5, pr=0.0, reward=1.8, feedback="Status: pass\nRuntime: slower than eager"),
        turn("eval", "kb-main-L1-19", 0, 2, code=SECOND_CODE, status="pass", correct=True, speedup_eager=2.5,
             speedup_compile=1.7, pr=0.9, reward=3.5, feedback="Status: pass"),
        turn("eval", "kb-main-L1-19", 0, 3, code=SECOND_CODE, status="pass", correct=True, speedup_eager=2.4,
             speedup_compile=1.6, pr=0.9, reward=3.4, feedback="Status: pass"),
    ]
    write_table(evaluation, results / "trajectories" / "stage=eval" / "run=default" / "part-0.parquet", "trajectories")
    rollouts = [
        turn("rl", "drkernel_rl-7", 0, 1, code=FIRST_CODE, status="hacked", hacked=True, speedup_eager=9.0,
             feedback="Status: hacked (the kernel skipped the work)\n"
                      "Hacking check failed: no Triton kernel launched; output is a view of the input"),
        turn("rl", "drkernel_rl-7", 0, 2, code=SECOND_CODE, status="pass", correct=True, speedup_eager=1.1,
             reward=2.1, feedback="Status: pass"),
        turn("rl", "drkernel_rl-7", 1, 1, response=f"I refuse to write code {ATTACK}",
             feedback=f"Status: format_error\nno code block in {ATTACK}"),
        turn("rl", "drkernel_rl-7", 1, 2, code=f'import triton\nBANNER = "{ATTACK}"\n', status="compilation_error",
             feedback="Status: compilation_error"),
    ]
    write_table(rollouts, results / "trajectories" / "stage=rl" / "run=default" / "iter=0" / "part-0.parquet",
                "trajectories")
    db = results / "kpipe.duckdb"
    build_db(results, db)
    return db


def page_data(path: Path) -> dict:
    """The payload a data/page-NNNN.js file registers (gzipped JSON in base64)."""
    match = re.fullmatch(r'kpipeViewer\.addPage\((\d+),"([A-Za-z0-9+/=]*)"\);\n', path.read_text())
    assert match, path.read_text()[:200]
    return json.loads(gzip.decompress(base64.b64decode(match.group(2))))


def embedded_index(index_html: str) -> list[dict]:
    match = re.search(r'<script type="application/json" id="kpipe-index">(.*?)</script>', index_html, re.S)
    return json.loads(match.group(1))


def detail_html(out: Path, entry: dict) -> str:
    data = page_data(out / "data" / f"page-{entry['file']:04d}.js")
    trajectory = data["trajectories"][str(entry["id"])]
    return trajectory["head"] + data["references"][trajectory["task"]] + trajectory["turns"]


def test_counts_index_and_sorted_view_keys(database, tmp_path):
    out = tmp_path / "viewer"
    assert build_viewer(database, out) == {"trajectories": 3, "turns": 7, "files": 1}
    page = (out / "index.html").read_text()
    assert "3 trajectories</b>, <b>7 turns" in page
    assert "<td>eval</td><td>default</td><td>0</td><td>tiny</td><td>1</td><td>3</td><td>1</td><td>0</td>" in page
    entries = embedded_index(page)
    assert [(e["stage"], e["task"], e["sample"]) for e in entries] == [  # pipeline order: rl before eval
        ("rl", "drkernel_rl-7", 0), ("rl", "drkernel_rl-7", 1), ("eval", "kb-main-L1-19", 0)]
    hacked, format_error, improving = entries
    assert hacked["hacked_turns"] == 1 and hacked["best_speedup"] == 1.1  # the hacked 9x does not count
    assert hacked["statuses"] == ["hacked", "pass"] and hacked["name"] == "gelu query"
    assert improving["best_speedup"] == 2.5 and improving["reward_change"] == pytest.approx(1.7)
    assert format_error["best_speedup"] is None and format_error["status"] == "compilation_error"


def test_turns_show_code_diff_feedback_reference_and_hack_reasons(database, tmp_path):
    out = tmp_path / "viewer"
    build_viewer(database, out)
    hacked, _, improving = embedded_index((out / "index.html").read_text())
    detail = detail_html(out, improving)
    assert detail.count('<div class="turn"') == 3
    assert "Diff against turn 1" in detail and "Diff against turn 2" in detail
    assert '<span class="gd">-        return x.clamp(min=0)</span>' in detail
    assert '<span class="gi">+        return relu_kernel(x)</span>' in detail
    assert "Same code as the previous turn." in detail  # turn 3 repeats turn 2
    assert '<span class="nf">forward</span>' in detail  # Pygments highlighted the code
    assert "torch</span><span class=\"o\">.</span><span class=\"n\">relu" in detail  # the task's reference
    assert "Runtime: slower than eager" in detail
    assert "2 message(s) (system 17, user 22 characters), 120 tokens" in detail
    assert "<th>speedup vs eager</th><td>2.5</td>" in detail
    assert "<th>PR (Triton share of time)</th><td>0.9</td>" in detail
    hacks = detail_html(out, hacked)
    assert "<li>no Triton kernel launched</li><li>output is a view of the input</li>" in hacks


def test_model_output_is_escaped_everywhere(database, tmp_path):
    out = tmp_path / "viewer"
    build_viewer(database, out)
    for path in out.rglob("*"):
        if path.is_file():
            assert "<script>alert" not in path.read_text()  # neither raw in a file ...
    _, format_error, _ = embedded_index((out / "index.html").read_text())
    detail = detail_html(out, format_error)
    assert "<script>alert" not in detail  # ... nor once the page decodes its JSON
    assert "I refuse to write code &lt;script&gt;alert(1)&lt;/script&gt;" in detail  # the response, as text
    assert "no code block in &lt;script&gt;alert(1)&lt;/script&gt;" in detail  # the feedback
    assert '"&lt;script&gt;alert(1)&lt;/script&gt;"' in detail  # inside highlighted code


def test_many_trajectories_are_paged_into_lazy_files(tmp_path):
    results = tmp_path / "results"
    rows = [turn("eval", f"kb-main-L1-{i}", 0, t, code=f"kernel_{i}_turn_{t} = 1\n", status="pass", correct=True,
                 speedup_eager=float(i % 7), reward=float(t))
            for i in range(230) for t in (1, 2)]
    write_table(rows, results / "trajectories" / "stage=eval" / "part-0.parquet", "trajectories")
    build_db(results, results / "kpipe.duckdb")
    out = results / "viewer"
    assert build_viewer(results / "kpipe.duckdb", out, per_file=50) == {"trajectories": 230, "turns": 460, "files": 5}
    page = (out / "index.html").read_text()
    entries = embedded_index(page)
    assert [e["file"] for e in entries] == [i // 50 for i in range(230)]
    assert "kernel_1_turn_1" not in page  # turn details stay in the data files until opened
    last = page_data(out / "data" / "page-0004.js")
    assert "kernel_99_turn_2" in json.dumps(last)  # the 230 ids sort as text: 99 comes last
    assert len(last["trajectories"]) == 30 and '"data/page-"' in page  # loaded by a <script> tag, not fetch()
    assert "fetch(" not in page
    parallel = results / "viewer-parallel"
    build_viewer(results / "kpipe.duckdb", parallel, per_file=50, workers=2)
    assert [p.read_bytes() for p in sorted(parallel.rglob("*.*"))] == [p.read_bytes() for p in sorted(out.rglob("*.*"))]


def test_rebuild_replaces_only_a_viewer_folder(database, tmp_path):
    out = tmp_path / "viewer"
    build_viewer(database, out)
    (out / "data" / "page-0099.js").write_text("stale")
    build_viewer(database, out)
    assert not (out / "data" / "page-0099.js").exists()
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        build_viewer(database, other)
    assert (other / "keep.txt").read_text() == "mine"


def show_in_node(out: Path) -> dict:
    """What the page shows in a minimal DOM (tests/fixtures/viewer/dom.js) after filtering, sorting and a click."""
    shown = subprocess.run(["node", str(DOM_SCRIPT), str(out)], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)


@needs_node
def test_page_filters_sorts_and_lazy_loads(database, tmp_path):
    out = tmp_path / "viewer"
    build_viewer(database, out)
    page = show_in_node(out)
    assert page["initial"] == 3 and page["shown"] == "3 of 3 trajectories"
    assert page["statusOptions"] == ["", "compilation_error", "format_error", "hacked", "pass"]
    assert [(row[4], row[9]) for row in page["hackedRows"]] == [("drkernel_rl-7", "1")]  # task, hacked turns
    assert (page["bestFirst"][4], page["bestFirst"][8]) == ("kb-main-L1-19", "2.5")
    assert page["jumpFirst"][4:6] == ["drkernel_rl-7", "0"]  # reward 0 -> 2.1 beats 1.8 -> 3.5
    assert page["scripts"] == ["data/page-0000.js"]  # the one script the page adds: the clicked row's data
    assert page["detail"].startswith("<h2>drkernel_rl-7") and "<b>Hack reasons</b>" in page["detail"]
    assert "Reference (PyTorch)" in page["detail"]


@needs_node
def test_page_lists_many_trajectories_a_hundred_at_a_time(tmp_path):
    results = tmp_path / "results"
    rows = [turn("eval", f"kb-main-L1-{i:03d}", 0, t, code=f"kernel_{i}_turn_{t} = 1\n", reward=float(t))
            for i in range(230) for t in (1, 2)]
    write_table(rows, results / "trajectories" / "stage=eval" / "part-0.parquet", "trajectories")
    build_db(results, results / "kpipe.duckdb")
    build_viewer(results / "kpipe.duckdb", tmp_path / "viewer", per_file=50)
    page = show_in_node(tmp_path / "viewer")
    assert (page["initial"], page["page"], page["nextPage"]) == (100, "page 1 / 3", "page 2 / 3")
    assert page["scripts"] == ["data/page-0002.js"]  # row 101 of 230 lives in the third data file
    assert "kernel_100_turn_2" in page["detail"]


def chromium() -> str:
    """Debian's chromium: the page's script is tested in the browser it runs in (.ci/run installs it)."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.fail("no chromium on PATH: apt-get install -y chromium (README, Tests)")


def show_in_chromium(out: Path, profile: Path) -> dict:
    """What tests/fixtures/viewer/drive.js saw as a user of the built page in headless Chromium."""
    page = (out / "index.html").read_text()
    driven = out / "driven.html"  # beside index.html, so data/ loads as it does for the page
    driven.write_text(page.replace("<head>", "<head>" + CATCH_ERRORS, 1)
                      .replace("</body>", f"<script>{DRIVER.read_text()}</script></body>", 1))
    shown = subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                            "--disable-component-update", "--no-first-run", f"--user-data-dir={profile}",
                            "--virtual-time-budget=10000", "--dump-dom", driven.as_uri()],
                           capture_output=True, text=True, timeout=120)
    report = re.search(r'<pre id="kpipe-test-report">(.*?)</pre>', shown.stdout, re.DOTALL)
    assert report, f"the driver wrote no report (chromium exit {shown.returncode}): {shown.stderr[-2000:]}"
    return json.loads(html.unescape(report.group(1)))


def test_page_lists_filters_and_shows_a_diff_in_headless_chromium(database, tmp_path):
    out = tmp_path / "viewer"
    build_viewer(database, out)
    page = show_in_chromium(out, tmp_path / "profile")
    assert page["errors"] == []  # nothing the page's script ran threw
    assert (page["shown"], page["rows"]) == ("3 of 3 trajectories", 3)
    assert page["filtered"] == {"shown": "1 of 3 trajectories", "tasks": ["drkernel_rl-7"]}  # status: hacked
    assert page["heading"].startswith("kb-main-L1-19") and page["turns"] == 3  # loaded from data/page-0000.js
    assert "-        return x.clamp(min=0)" in page["removed"]
    assert "+        return relu_kernel(x)" in page["added"]


def test_cli_builds_the_viewer(database, tmp_path):
    out = tmp_path / "viewer"
    result = CliRunner().invoke(view_command, ["--db", str(database), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "3 trajectories, 7 turns, 1 data file(s)" in result.output
    assert (out / "index.html").exists()


def test_view_uses_the_current_directory_and_says_when_no_browser_opens(database, tmp_path, monkeypatch):
    """`kpipe view` reads and writes ./results (not the installed checkout's); `--open` without a
    browser says so instead of nothing."""
    monkeypatch.chdir(database.parent.parent)  # the folder holding results/
    monkeypatch.setattr("webbrowser.open", lambda url: False)
    result = CliRunner().invoke(view_command, ["--open", "--workers", "1"])
    assert result.exit_code == 0, result.output
    assert (database.parent / "viewer" / "index.html").exists()
    assert "no browser could be started here" in result.output


LAYOUT_PROBE = """<script>
const box = document.getElementById("list");
const list = box.getBoundingClientRect();
const heads = Array.from(box.querySelectorAll("th"));
document.body.dataset.layout = JSON.stringify({listRight: list.right, listHeight: list.height,
  viewportHeight: innerHeight, lastColumnRight: heads[heads.length - 1].getBoundingClientRect().right});
</script></body>"""


def test_list_shows_every_column_at_1400_px(tmp_path):
    """In a 1400 px window, long run, model and task names leave every column of the list in view, and
    the list scrolls inside the window (a narrower one reaches its scroll bar without paging down)."""
    results = tmp_path / "results"
    rows = [turn("rl_val", f"kb-main-L2-{i}", 0, t, run="tritonforge_released", iteration=29,
                 model="drkernel-14b-rl@16x8", status="compilation_error", reward=0.123, speedup_eager=1.234)
            for i in range(120) for t in (1, 2)]
    write_table(rows, results / "trajectories" / "stage=rl_val" / "part-0.parquet", "trajectories")
    build_db(results, results / "kpipe.duckdb")
    build_viewer(results / "kpipe.duckdb", tmp_path / "viewer")
    probe = tmp_path / "viewer" / "probe.html"
    probe.write_text((tmp_path / "viewer" / "index.html").read_text().replace("</body>", LAYOUT_PROBE))
    dom = subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                          "--disable-component-update", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
                          "--window-size=1400,900", "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=120).stdout
    layout = json.loads(re.search(r'data-layout="([^"]*)"', dom).group(1).replace("&quot;", '"'))
    assert layout["lastColumnRight"] <= layout["listRight"], layout
    assert layout["listHeight"] <= layout["viewportHeight"], layout


NAME_COLUMNS = {"stage": 0, "run": 1, "model": 3, "task": 4, "status": 7}
WRAP_PROBE = """<script>
// Every line break inside a name cell of the list, found from each character's box: a break is
// mid-word unless the character before it is a separator (_ - @ / . =)
const SEPARATOR = /[_\\-@\\/.=]/;
const box = document.getElementById("list");
const midWord = [];
let wrapped = 0;
for (const row of box.querySelectorAll("tbody tr")) {
  for (const [column, index] of Object.entries(COLUMNS)) {
    const cell = row.children[index];
    const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
    const range = document.createRange();
    let lastTop = null, previous = "", node;
    while ((node = walker.nextNode())) {
      for (let i = 0; i < node.length; i++) {
        range.setStart(node, i); range.setEnd(node, i + 1);
        const rects = range.getClientRects();
        if (!rects.length) continue;
        if (lastTop !== null && rects[0].top > lastTop + 1) {
          wrapped += 1;
          if (!SEPARATOR.test(previous)) midWord.push(column + ": " + cell.textContent);
        }
        lastTop = rects[0].top; previous = node.data[i];
      }
    }
  }
}
const heads = Array.from(box.querySelectorAll("th"));
document.body.dataset.layout = JSON.stringify({midWord, wrapped, listRight: box.getBoundingClientRect().right,
  lastColumnRight: heads[heads.length - 1].getBoundingClientRect().right,
  scrolls: box.scrollWidth > box.clientWidth, hintShown: !(document.getElementById("list-hint") || {hidden: true}).hidden});
</script></body>"""


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


@pytest.mark.parametrize("width", [800, 1400])
def test_names_never_break_mid_word_and_the_list_fits_or_says_it_scrolls(tmp_path, width):
    """At 800 and 1,400 px: stage, run, model, task and status names wrap only after a separator
    ("tritonforge_|released", never "coldst|art" or "def|ault"); at 1,400 px every column is in view,
    at 800 px those that are not are a sideways scroll away and a line above the list says so. A
    screenshot of the page at the width is taken and compared with the window it shows."""
    results = tmp_path / "results"
    rows = [turn(stage, f"kb-main-L2-{i}", 0, t, run=run, iteration=29, model=model, status=status, reward=0.123,
                 speedup_eager=1.234)
            for i in range(40) for t in (1, 2)
            for stage, run, model, status in (("coldstart", "default", "teacher", "compilation_error"),
                                              ("rl_val", "tritonforge_released", "drkernel-14b-rl@16x8", "mismatch"))]
    write_table(rows, results / "trajectories" / "part-0.parquet", "trajectories")
    build_db(results, results / "kpipe.duckdb")
    out = tmp_path / "viewer"
    build_viewer(results / "kpipe.duckdb", out)
    probe = out / "probe.html"
    probe.write_text((out / "index.html").read_text().replace(
        "</body>", WRAP_PROBE.replace("COLUMNS", json.dumps(NAME_COLUMNS))))
    browser = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--no-first-run", "--hide-scrollbars",
               f"--user-data-dir={tmp_path / 'profile'}", f"--window-size={width},900"]
    dom = subprocess.run([*browser, "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=120).stdout
    layout = json.loads(html.unescape(re.search(r'data-layout="([^"]*)"', dom).group(1)))
    assert layout["midWord"] == [], layout["midWord"][:5]
    if width >= 1400:
        assert layout["lastColumnRight"] <= layout["listRight"] and not layout["hintShown"], layout
    else:
        assert layout["lastColumnRight"] <= layout["listRight"] or (layout["scrolls"] and layout["hintShown"]), layout
    screenshot = tmp_path / f"viewer-{width}.png"
    subprocess.run([*browser, f"--screenshot={screenshot}", (out / "index.html").as_uri()], capture_output=True,
                   timeout=120)
    assert png_size(screenshot) == (width, 900)
