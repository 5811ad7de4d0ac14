"""The guides point at each other by link and by section name; a link or a name that no longer leads
anywhere is a dead end for a reader. Every relative Markdown link in README.md, config/README.md and
docs/*.md names a file that exists and, with `#anchor`, a heading of it (GitHub's anchors); every
`docs/<file>.md, "Section"` reference names a section that file still has (a heading or a bold lead-in)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDES = sorted([ROOT / "README.md", ROOT / "config" / "README.md", *(ROOT / "docs").glob("*.md")])
# code that sends its reader to a section of a guide (an error message, a comment)
CODE = sorted(path for pattern in ("src/**/*.py", "workflow/**/*.smk", "workflow/sql/*.sql", "tests/*.py",
                                   "checks/**/*.py", "scripts/*.py", "benchmarks/*.py")
              for path in ROOT.glob(pattern) if path.name != "test_docs_links.py")
LINK = re.compile(r"\]\(([^)\s]+)\)")
# `docs/rl.md`, "Several GPUs"  /  docs/kernelgym.md, 'Limits'  /  (`docs/training.md`, "The trainer's memory")
SECTION_REF = re.compile(r"`?((?:docs/)?[\w.-]+\.md)`?,? (?:\"([^\"\n]{3,80})\"|'([^'\n]{3,80})'(?!\w))")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but `-` and `_` dropped, spaces to `-`, repeats numbered."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in FENCE.sub("", path.read_text()).splitlines():
        heading = re.match(r"#{1,6} (.*)", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def sections(path: Path) -> set[str]:
    """What a reference may name: a heading's text (or its part before a colon or a parenthesis) or a bold lead-in."""
    text = path.read_text()
    names = set()
    for heading in re.findall(r"^#{1,6} (.*)$", FENCE.sub("", text), re.M):
        heading = heading.replace("`", "")
        names |= {heading, re.sub(r"\s*\(.*$", "", heading), heading.split(":")[0]}
    names |= {bold.rstrip(".:") for bold in re.findall(r"\*\*([^*]+)\*\*", text)}
    return names


def test_the_checks_can_fail(tmp_path: Path) -> None:
    """GitHub's anchors (punctuation dropped, repeats numbered), and a section name that is not there."""
    page = tmp_path / "page.md"
    page.write_text("# What's new in v2 (rc1)\n## A\n## A\n- **Limits** (`x`): ...\n## Serving: `vllm serve`\n")
    assert {"whats-new-in-v2-rc1", "a", "a-1"} <= anchors(page)
    assert {"Limits", "Serving", "What's new in v2"} <= sections(page)
    refs = SECTION_REF.findall('''see `docs/page.md`, "Timing: the judge's clock" and docs/page.md, 'Limits'.''')
    assert [(name, double or single) for name, double, single in refs] == [
        ("docs/page.md", "Timing: the judge's clock"), ("docs/page.md", "Limits")]
    assert "Timing: the judge's clock" not in sections(page)


@pytest.mark.parametrize("guide", GUIDES, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_link_leads_somewhere(guide: Path) -> None:
    broken = []
    for target in LINK.findall(FENCE.sub("", guide.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        resolved = (guide.parent / path).resolve() if path else guide
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor}")
    assert not broken, f"{guide.relative_to(ROOT)}: " + "; ".join(broken)


def missing_sections(guide: Path) -> list[str]:
    missing = []
    for name, double, single in SECTION_REF.findall(guide.read_text()):
        section = double or single
        target = ROOT / name if name.startswith("docs/") else guide.parent / name
        if not target.exists():
            continue  # a paper or a file outside the repository (papers/kevin.md)
        if section not in sections(target):
            missing.append(f"{name}, {section!r}")
    return missing


@pytest.mark.parametrize("guide", GUIDES, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_section_named_exists(guide: Path) -> None:
    missing = missing_sections(guide)
    assert not missing, f"{guide.relative_to(ROOT)} names sections that are gone: " + "; ".join(missing)


def test_every_section_the_code_names_exists() -> None:
    missing = {str(path.relative_to(ROOT)): found for path in CODE if (found := missing_sections(path))}
    assert not missing, f"code names sections of the guides that are gone: {missing}"
