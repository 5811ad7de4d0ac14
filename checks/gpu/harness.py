"""What every GPU check does alike, written once: empty compile caches, the device's facts, the
report (Markdown and JSON), the exit status, and the suite split into device calls.

On the GPU device (it runs ``python3`` with torch preinstalled, in a copy of this repository's tree,
which has no ``.git``: pass the commit in ``KPIPE_COMMIT``)::

    . scripts/device_env.sh                      # the carried wheels (.whl/), src/ on PYTHONPATH
    python3 -m checks.gpu --list                 # every check, its sections, the calls of <= 10 minutes
    KPIPE_COMMIT=abc1234 python3 -m checks.gpu --call 3        # call 3 of the suite, reports under $OUT
    KPIPE_COMMIT=abc1234 python3 -m checks.gpu gym hacks faults  # one check (all sections without names)

Each run overwrites its check's current report ``<check>.md`` under ``$OUT`` (with its data,
``<check>.json``) and appends its key figures to ``$OUT/ledger.jsonl`` (``kpipe.infra.ledger``).
Here, afterwards: ``python -m checks.gpu --combine DIR ... --out docs/gpu-results`` records one report
and ledger line per check from the calls' folders. A check is a module of ``checks.gpu`` with ``TITLE``,
``SECTIONS`` (``Section``: a name, its expected seconds on one H100 from empty caches, the function that
checks), where it takes options ``add_options(parser)``, and where it has key figures beyond whether it
held ``figures(report_json) -> dict`` (for the ledger). A check with ``KEEPS_SECTIONS = True`` has one
current report merged from runs of some of its sections (each on the card it needs): a run, or ``--combine``,
starts from the report's data ``<check>.json`` in the results folder and replaces only the sections it ran;
each section names the card, commit and date it was measured on, and the ledger line holds this run's figures
only. A section function writes into the ``Report`` it is given and fails by ``report.row(..., ok=False)``,
``report.expect(...)`` or ``raise CheckFailed``; the harness runs each section once, saves the report after
it and exits 1 when any section failed, raised, or was not reached within the time budget.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from checks.gpu import CHECKS
from kpipe.infra import ledger

ROOT = Path(__file__).resolve().parents[2]
COMPILE_CACHES = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")
CALL_LIMIT_S = 540  # a device command may run 600 s; a tenth is left for start-up and the transfers


class CheckFailed(Exception):
    """What the section checks does not hold: the section stops and the check exits 1."""


@dataclass(frozen=True)
class Section:
    """One part of a check; `seconds` (wall time on one H100 from empty caches) packs the suite's calls."""

    name: str
    seconds: int
    run: Callable[[Report, argparse.Namespace], None]
    gpus: int = 1
    # False: the section reads what a run outside the check left (paper_units rl_step, the one-GPU smoke under
    # Snakemake, longer than a call), so the suite and a check run without names leave it out; it runs by name
    in_suite: bool = True


def cold_caches(move_home: bool | None = None) -> dict[str, str]:
    """Fresh, empty compile caches for this process and everything it starts, so that a check cannot
    pass on kernels an earlier run compiled. Triton and Inductor read the variables when imported,
    hence the refusal once they are. ~/.triton goes aside only on a GPU machine (never a shared CPU one)."""
    loaded = [name for name in ("torch", "triton") if name in sys.modules]
    if loaded:
        raise RuntimeError(f"{loaded} imported before the compile caches were set")
    fresh = {name: tempfile.mkdtemp(prefix=f"cold-{name.lower()}-") for name in COMPILE_CACHES}
    for path in fresh.values():  # removed when the check's process ends: nothing of a check stays behind
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    os.environ.update(fresh)
    home_triton = Path.home() / ".triton"
    if (shutil.which("nvidia-smi") is not None if move_home is None else move_home) and home_triton.exists():
        home_triton.rename(home_triton.with_name(f".triton.aside-{int(time.time())}"))
    return fresh


def _command(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def device_facts() -> dict[str, Any]:
    """The device, software and code a result holds for: every report names them."""
    import torch
    import triton

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    driver = _command(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).splitlines()
    return {"device": torch.cuda.get_device_name(0) if gpus else "cpu", "gpus": gpus,
            "driver": driver[0] if driver else "none", "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda or "none", "python": sys.version.split()[0],
            "commit": ledger.current_commit(), "date": ledger.utc_now()}


def section_facts(facts: dict[str, Any]) -> dict[str, Any]:
    """What one section was measured on and when: a report merged from several runs names it section by section."""
    return {key: facts.get(key, 0 if key == "gpus" else "unknown") for key in ("device", "gpus", "commit", "date")}


def facts_line(facts: dict[str, Any]) -> str:
    return (f"{facts['date']} on {facts['device']}{' x' + str(facts['gpus']) if facts.get('gpus', 0) > 1 else ''} "
            f"(driver {facts['driver']}); torch {facts['torch']} (CUDA {facts['cuda']}), triton {facts['triton']}, "
            f"Python {facts['python']}; commit {facts['commit']}")


def exit_status(failures: Iterable[str]) -> int:
    """0 when nothing failed, else 1 after naming each failure on stderr (what a device log shows first)."""
    failed = list(failures)
    for failure in failed:
        print(f"FAIL: {failure}", file=sys.stderr, flush=True)
    return 1 if failed else 0


def _cell(value: Any) -> str:
    return str(value).replace("|", "/").replace("\n", " ")[:200]


class Report:
    """A check's report, section by section: Markdown lines, structured data and failures."""

    def __init__(self, check: str, title: str, facts: dict[str, Any], part: tuple[str, ...] = (),
                 out: Path | None = None, budget_s: float | None = None, merge_order: tuple[str, ...] = ()) -> None:
        """`merge_order`: every section of a check whose report keeps the sections a run does not run
        (``KEEPS_SECTIONS``), in the check's order; empty: the report is this run's alone."""
        self.check, self.title, self.facts, self.part, self.out = check, title, facts, part, out
        self.merge_order = merge_order
        self.deadline = time.monotonic() + budget_s if budget_s else None
        self.sections: dict[str, dict[str, Any]] = {}
        self.current: dict[str, Any] = {}

    # ---- what a section writes
    def begin(self, name: str) -> None:
        self.current = self.sections[name] = {"lines": [], "failures": [], "data": {}, "done": False, "wall_s": None,
                                              "facts": section_facts(self.facts)}
        print(f"\n## {name}", flush=True)

    @property
    def data(self) -> dict[str, Any]:
        """The current section's structured results (its JSON)."""
        return self.current["data"]

    def line(self, *texts: str) -> None:
        self.current["lines"].extend(texts)
        for text in texts:
            print(text, flush=True)

    def rewrite(self, *texts: str) -> None:
        """Replace the current section's lines (a report that grows as the check goes) and save."""
        self.current["lines"] = list(texts)
        self.save()

    def table(self, *header: str) -> None:
        self.line("", "| " + " | ".join(header) + " |", "|" + "---|" * len(header))

    def row(self, *cells: Any, ok: bool = True) -> None:
        """A table row; `ok=False` makes it a failure named by its first cell."""
        self.line("| " + " | ".join(_cell(c) for c in cells) + " |")
        if not ok:
            self.fail(str(cells[0]))

    def fail(self, what: str) -> None:
        self.current["failures"].append(what)

    def expect(self, ok: bool, what: str) -> bool:
        """Record `what` as a failure unless `ok`; returns `ok`."""
        if not ok:
            self.fail(what)
        return ok

    def item(self, name: str, width: int, check: Callable[[], tuple[bool, list[Any]]]) -> None:
        """One row from `check` (whether it holds, the cells after `name`): an exception or the time
        budget fails the row and never the rest of the section."""
        if self.out_of_time():
            self.row(name, "not run (time budget)", *[""] * (width - 2), ok=False)
            return
        try:
            ok, cells = check()
        except Exception as exc:  # noqa: BLE001 - the section goes on with its next item
            traceback.print_exc()
            self.row(name, f"ERROR {type(exc).__name__}: {exc}", *[""] * (width - 2), ok=False)
            return
        self.row(name, *cells, ok=ok)

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    # ---- the report
    def keep(self, earlier: dict[str, Any] | None, running: Iterable[str] = ()) -> None:
        """Carry the sections of the earlier current report `earlier` (its JSON) that this run does not run,
        each with what it was measured on (the earlier report's facts where a section has none)."""
        if earlier is None:
            return
        skip = set(running)
        for name, section in earlier["sections"].items():
            if name not in skip:
                self.sections[name] = {**section, "facts": section.get("facts") or section_facts(earlier["facts"]),
                                       "kept": True}

    def ordered(self, fresh_only: bool = False) -> dict[str, dict[str, Any]]:
        """The sections in the check's order (`merge_order`; else as run), only this run's with `fresh_only`."""
        order = {name: index for index, name in enumerate(self.merge_order)}
        chosen = [(name, s) for name, s in self.sections.items() if not (fresh_only and s.get("kept"))]
        return dict(sorted(chosen, key=lambda item: order.get(item[0], len(order))) if order else chosen)

    @property
    def failures(self) -> list[str]:
        """This run's failures (a section kept from an earlier run fails no later one)."""
        return _failures(self.ordered(fresh_only=True))

    def markdown(self) -> str:
        command = " ".join(("python -m checks.gpu", self.check, *self.part))
        lines = [f"# {self.title}", "", f"`{command}`: {facts_line(self.facts)}."]
        sections = self.ordered()
        kept = [name for name, section in sections.items() if section.get("kept")]
        if kept:
            lines.append(f"Kept from earlier runs (`python -m checks.gpu {self.check} SECTION ...`): "
                         f"{', '.join(kept)}. Each section names the card, commit and date it was measured on.")
        for name, section in sections.items():
            wall = f", {section['wall_s']:.0f} s" if section["wall_s"] is not None else ", did not finish"
            verdict = "FAIL" if section["failures"] else "ok" if section["done"] else "incomplete"
            lines += ["", f"## {name} ({verdict}{wall})"]
            if self.merge_order:
                where = section.get("facts") or section_facts(self.facts)
                gpus = f" x{where['gpus']}" if where.get("gpus", 0) > 1 else ""
                lines.append(f"Measured on {where['device']}{gpus}, commit {where['commit']}, {where['date']}"
                             f"{' (an earlier run)' if section.get('kept') else ''}.")
            lines += section["lines"]
            lines += [f"- FAIL: {what}" for what in section["failures"]]
        failures = _failures(sections)
        lines += ["", f"**{'FAIL' if failures else 'PASS'}**: " + ("; ".join(failures) if failures else
                                                               "every section as expected") + "."]
        return "\n".join(lines) + "\n"

    def to_json(self, fresh_only: bool = False) -> dict[str, Any]:
        """The report's data; `fresh_only`: this run's sections alone (what its ledger line holds)."""
        sections = self.ordered(fresh_only)
        return {"check": self.check, "title": self.title, "facts": self.facts, "part": list(self.part),
                "sections": sections, "ok": not _failures(sections)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Report:
        report = cls(data["check"], data["title"], data["facts"], tuple(data.get("part", ())))
        report.sections = {name: {**section, "facts": section.get("facts") or section_facts(data["facts"])}
                           for name, section in data["sections"].items()}
        return report

    def save(self) -> None:
        """The current report `<check>.md` and its data `<check>.json` under `out` (written after every
        section, and by a section whenever it wants: a call stopped at its limit keeps what ran)."""
        if self.out is None:
            return
        ledger.write_report(self.out, self.check, self.markdown())
        self.write_json(self.out)

    def write_json(self, folder: Path) -> None:
        (folder / f"{self.check}.json").write_text(json.dumps(self.to_json(), indent=2, default=str))

    def record(self, results: Path) -> dict[str, Any]:
        """The finished run: its report and a ledger line of this run's key figures under `results`; a merged
        report's data too (the next run of some of its sections starts from it)."""
        line = ledger.record(self.check, self.markdown(), key_figures(self.to_json(fresh_only=True)),
                             ledger.device_label(self.facts["device"], self.facts.get("gpus", 0)),
                             results=results, commit=self.facts["commit"], date=self.facts["date"])
        if self.merge_order:
            self.write_json(results)
        return line


def _failures(sections: dict[str, dict[str, Any]]) -> list[str]:
    return [f"{name}: {what}" for name, section in sections.items() for what in section["failures"]]


def current_report(results: Path | None, check: str) -> dict[str, Any] | None:
    """The data of the check's current report under `results`, where there is one."""
    path = results / f"{check}.json" if results is not None else None
    return json.loads(path.read_text()) if path is not None and path.exists() else None


def merge_order(module: ModuleType) -> tuple[str, ...]:
    """Every section of a check whose report keeps the sections a run does not run (``KEEPS_SECTIONS``), else ()."""
    return tuple(section.name for section in module.SECTIONS) if getattr(module, "KEEPS_SECTIONS", False) else ()


def key_figures(report: dict[str, Any]) -> dict[str, Any]:
    """A report's ledger figures: whether it held, its seconds, the sections run when not all,
    and the check's own (its module's ``figures``)."""
    module = load(report["check"])
    figures: dict[str, Any] = {"ok": report["ok"],
                               "wall_s": round(sum(s["wall_s"] or 0 for s in report["sections"].values()), 1)}
    if report.get("part"):
        figures["sections"] = ",".join(report["part"])
    return {**figures, **(module.figures(report) if hasattr(module, "figures") else {})}


def load(check: str) -> ModuleType:
    if check not in CHECKS:
        raise KeyError(f"unknown check {check!r}; the checks: {', '.join(CHECKS)}")
    return importlib.import_module(f"checks.gpu.{check}")


def sections_of(module: ModuleType) -> dict[str, Section]:
    return {section.name: section for section in module.SECTIONS}


def run_check(check: str, names: list[str], options: argparse.Namespace, out: Path | None) -> int:
    """Run `names` (every section of the suite when empty) of one check in this process, from empty compile caches."""
    caches = cold_caches()
    src = str(ROOT / "src")  # absolute: evaluation children run in scratch directories
    if src not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))
    module = load(check)
    every = sections_of(module)
    chosen = [every[name] for name in names] if names else [section for section in every.values() if section.in_suite]
    facts = {**device_facts(), "compile_caches": caches}
    part = tuple(s.name for s in chosen) if len(chosen) < len(every) else ()
    report = Report(check, module.TITLE, facts, part, out, options.budget_s, merge_order(module))
    if report.merge_order:
        report.keep(current_report(out, check), (s.name for s in chosen))
    print(f"# {module.TITLE}\n{facts_line(facts)}", flush=True)
    for section in chosen:
        report.begin(section.name)
        started = time.monotonic()
        try:
            if report.out_of_time():
                raise CheckFailed("not run (time budget)")
            section.run(report, options)
        except CheckFailed as failure:
            report.fail(str(failure))
        except Exception as exc:  # noqa: BLE001 - the next section still runs
            traceback.print_exc()
            report.fail(f"ERROR {type(exc).__name__}: {exc}")
        report.current.update(done=True, wall_s=time.monotonic() - started)
        report.save()
    if out is not None:
        report.record(out)
    print(report.markdown().rsplit("\n\n", 1)[-1], flush=True)
    return exit_status(report.failures)


# --------------------------------------------------------------------------- the suite in calls


@dataclass(frozen=True)
class Target:
    """Sections of one check run in one process of a call."""

    check: str
    sections: tuple[str, ...]
    seconds: int
    gpus: int

    def argv(self, budget_s: float) -> list[str]:
        return [sys.executable, "-m", "checks.gpu", self.check, *self.sections, "--budget-s", f"{budget_s:.0f}"]


def suite() -> list[tuple[str, Section]]:
    return [(check, section) for check in CHECKS for section in load(check).SECTIONS if section.in_suite]


def plan(units: list[tuple[str, Section]], limit_s: int = CALL_LIMIT_S) -> list[list[Target]]:
    """The sections in suite order packed into calls whose expected seconds add up to at most
    `limit_s`, consecutive sections of one check in one process; a call needs one machine, so
    sections on different numbers of GPUs never share one. A section longer than the limit is a call alone."""
    calls: list[list[Target]] = []
    for check, section in units:
        call = calls[-1] if calls else []
        if not call or call[0].gpus != section.gpus or sum(t.seconds for t in call) + section.seconds > limit_s:
            calls.append([Target(check, (section.name,), section.seconds, section.gpus)])
        elif call[-1].check == check:
            last = call[-1]
            call[-1] = Target(check, (*last.sections, section.name), last.seconds + section.seconds, last.gpus)
        else:
            call.append(Target(check, (section.name,), section.seconds, section.gpus))
    return calls


def run_call(call: list[Target], out: Path, limit_s: int = CALL_LIMIT_S) -> int:
    """One call's targets one after another, each in its own process (its own empty caches), each
    given what is left of the call's time as its budget."""
    started = time.monotonic()
    failures = []
    for target in call:
        argv = target.argv(max(1.0, limit_s - (time.monotonic() - started)))
        print(f"== {' '.join(argv[2:])}", flush=True)
        done = subprocess.run(argv, cwd=ROOT, env={**os.environ, "OUT": str(out)})
        if done.returncode:
            failures.append(f"{target.check} {','.join(target.sections)} exited {done.returncode}")
    return exit_status(failures)


def combine(folders: list[Path], out: Path) -> list[Path]:
    """One report and ledger line per check from the reports of several calls (a later folder's
    section supersedes an earlier one's of the same name); returns the reports written."""
    merged: dict[str, Report] = {}
    for folder in folders:
        for path in sorted(folder.glob("*.json")):
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or {"check", "sections", "facts"} - set(data):
                continue
            part = Report.from_json(data)
            if part.check not in merged:  # a check that keeps sections starts from its current report under `out`
                merged[part.check] = Report(part.check, part.title, part.facts, merge_order=merge_order(load(part.check)))
                if merged[part.check].merge_order:
                    merged[part.check].keep(current_report(out, part.check))
            whole = merged[part.check]
            whole.facts = part.facts if part.facts["date"] >= whole.facts["date"] else whole.facts
            whole.sections.update(part.sections)
    for check, report in merged.items():
        order = [s.name for s in load(check).SECTIONS]
        report.sections = dict(sorted(report.sections.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))
        fresh = report.ordered(fresh_only=True)
        report.part = tuple(name for name in order if name in fresh) if set(order) - set(fresh) else ()
        report.record(out)
    if out.resolve() == ledger.RESULTS.resolve():
        ledger.write_docs()
    return [out / f"{check}.md" for check in merged]


def out_dir(given: Path | None) -> Path:
    """Where reports go: --out, else $OUT (what comes back from the device), else results/gpu-checks."""
    return given or Path(os.environ.get("OUT") or ROOT / "results" / "gpu-checks")


def main(argv: list[str] | None = None) -> int:
    # --help is added once the check's own options are (a first parse with it would print the help without them)
    parser = argparse.ArgumentParser(prog="python -m checks.gpu", description=__doc__, add_help=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", nargs="*", metavar="CHECK [SECTION ...]", help="one check and some of its sections")
    parser.add_argument("--list", action="store_true", help="every check's sections and the suite's calls")
    parser.add_argument("--call", type=int, help="run call K (1-based) of the suite")
    parser.add_argument("--combine", nargs="+", type=Path, metavar="DIR",
                        help="one report and ledger line per check from these folders")
    parser.add_argument("--out", type=Path, help="reports folder (default $OUT, else results/gpu-checks)")
    parser.add_argument("--budget-s", type=float, help="fail the sections and items not started within this many seconds")
    known, _ = parser.parse_known_args(argv)
    parser.add_argument("-h", "--help", action="help", help="show this help message and exit")
    module = load(known.target[0]) if known.target and known.target[0] in CHECKS else None
    if module is not None and hasattr(module, "add_options"):
        module.add_options(parser.add_argument_group(f"{known.target[0]} options"))
    args = parser.parse_args(argv)
    calls = plan(suite())
    if args.list:
        for check in CHECKS:
            print(f"{check}: {load(check).TITLE}")
            for section in load(check).SECTIONS:
                print(f"  {section.name:<14} ~{section.seconds} s" + (f", {section.gpus} GPUs" if section.gpus > 1 else ""))
        for number, call in enumerate(calls, 1):
            gpus = f", {call[0].gpus} GPUs" if call[0].gpus > 1 else ""
            print(f"call {number} (~{sum(t.seconds for t in call)} s{gpus}): "
                  + "; ".join(f"{t.check} {' '.join(t.sections)}" for t in call))
        return 0
    if args.combine:
        for path in combine(args.combine, out_dir(args.out)):
            print(path)
        return 0
    if args.call is not None:
        if not 1 <= args.call <= len(calls):
            parser.error(f"--call must be 1 to {len(calls)}")
        return run_call(calls[args.call - 1], out_dir(args.out))
    if module is None:
        parser.error(f"name a check ({', '.join(CHECKS)}), or --list, --call K or --combine DIR ...")
    unknown = [name for name in args.target[1:] if name not in sections_of(module)]
    if unknown:
        parser.error(f"{args.target[0]} has no section {', '.join(unknown)}; its sections: {', '.join(sections_of(module))}")
    return run_check(args.target[0], args.target[1:], args, out_dir(args.out))
