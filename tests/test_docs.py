"""The repository's own references resolve: every citation of the design document names a
section (and sub-item) that exists, and no file cites a document that is not here."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
CITATION = re.compile(r'design\.md §(\d+)(?: "([^"]+)")?')


def tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.py", "*.md"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
    return [ROOT / f for f in out if not f.startswith("docs/results/")]


def design_sections() -> dict[str, set[str]]:
    """Section number -> the names of its sub-items (``### name`` headings)."""
    sections: dict[str, set[str]] = {}
    current = None
    for line in DESIGN.read_text(encoding="utf-8").splitlines():
        if m := re.match(r"## (\d+)\. ", line):
            current = m.group(1)
            sections[current] = set()
        elif line.startswith("### ") and current is not None:
            sections[current].add(line[4:].strip())
    return sections


def test_design_sections_are_read():
    sections = design_sections()
    assert set(sections) == {str(i) for i in range(1, 11)}
    assert "Attention math" in sections["4"]


def test_every_design_citation_resolves():
    sections = design_sections()
    files = tracked_text_files()
    wrong, seen = [], 0
    for path in files:
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for number, item in CITATION.findall(line):
                seen += 1
                if number not in sections or (item and item not in sections[number]):
                    wrong.append(f"{path.relative_to(ROOT)}:{lineno}: §{number} {item!r}")
    assert seen > 40  # the code does cite it; a broken pattern would find nothing
    assert not wrong, "citations of docs/design.md that do not resolve:\n" + "\n".join(wrong)


def test_no_citation_of_a_document_outside_the_repository():
    stale = re.compile(r"\bDESIGN §|\bSTYLE \d|/work/|seeds/\d{3}_")
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in tracked_text_files()
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
            if stale.search(line) and p != Path(__file__)]
    assert not hits, hits
