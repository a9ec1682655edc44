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


# --------------------------------------------------------------------------- the front door

README = ROOT / "README.md"
README_MAX_LINES = 250
#: The front pages: the README and the two pages it sends readers to first.
FRONT_PAGES = [README, ROOT / "docs" / "benchmarks.md", ROOT / "docs" / "status.md"]
#: Every page a user reads: they speak of the project, not of its issue tracker.
USER_DOCS = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "csrc" / "README.md"]
ISSUE_NUMBER = re.compile(r"(?<![\w/])#\d+\b|\bissues?\s+#?\d", re.IGNORECASE)
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`]+)`")
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")


def issue_numbers(text: str) -> list[str]:
    return [f"{i}: {line.strip()[:80]}" for i, line in enumerate(text.splitlines(), 1)
            if ISSUE_NUMBER.search(line)]


def test_the_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


def test_the_user_docs_name_no_issue_numbers():
    assert issue_numbers("see #41, issue 39 and issues #7; a link docs/design.md#2-parts") == [
        "1: see #41, issue 39 and issues #7; a link docs/design.md#2-parts"]
    assert issue_numbers("Built (issue #39).\n# vLLM on the pool (issue #18)") == [
        "1: Built (issue #39).", "2: # vLLM on the pool (issue #18)"]
    # another project's tracker, named with its repository, is a citation, not ours
    assert not issue_numbers("C = 64 · docs/design.md#2-parts · `pytest -m gpu` · org/repo#1155")
    names = {p.relative_to(ROOT).as_posix() for p in USER_DOCS}
    assert {"docs/design.md", "docs/vllm.md", "csrc/README.md"} <= names  # the glob found them
    found = {p.relative_to(ROOT).as_posix(): issue_numbers(p.read_text(encoding="utf-8"))
             for p in USER_DOCS}
    found = {name: hits for name, hits in found.items() if hits}
    assert not found, found


def test_the_front_pages_links_resolve():
    missing = []
    for page in FRONT_PAGES:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if target.startswith(("http://", "https://", "#")):
                continue
            if not (page.parent / target.split("#", 1)[0]).exists():
                missing.append(f"{page.relative_to(ROOT)}: {target}")
    assert not missing, missing


def test_the_readme_links_every_doc():
    text = README.read_text(encoding="utf-8")
    docs = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert {"benchmarks.md", "status.md", "design.md"} <= set(docs)
    assert not [d for d in docs if f"(docs/{d})" not in text]


def headline_rows() -> list[list[str]]:
    section = README.read_text(encoding="utf-8").split("## Headline figures", 1)[1]
    section = section.split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[c.strip() for c in row.strip("|").split(" | ")] for row in rows[2:]]


def test_every_headline_figure_names_its_command():
    rows = headline_rows()
    assert 6 <= len(rows) <= 12
    for what, figure, command in rows:
        assert figure and len(figure) <= 100, (what, figure)
        assert re.match(r"`(tokenlake|make) ", command), (what, command)


def tokenlake_command_lines(text: str) -> list[str]:
    """``tokenlake ...`` as the pages show it: code spans, and lines of shell blocks."""
    spans = [" ".join(s.split()) for s in CODE_SPAN.findall(text.replace("```", ""))]
    for block in re.findall(r"```sh\n(.*?)```", text, re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            spans.append(" ".join(line.split("#", 1)[0].rstrip(" &").split()))
    found = []
    for span in spans:
        words = span.split()
        while words and ENV_ASSIGNMENT.match(words[0]):
            words = words[1:]
        if words[:1] == ["tokenlake"] and len(words) > 1:
            found.append(" ".join(words))
    return found


def test_the_commands_the_pages_show_exist(capsys):
    from tokenlake.tools.cli import build_parser

    pages = [README, ROOT / "docs" / "benchmarks.md"]
    commands = [c for p in pages for c in tokenlake_command_lines(p.read_text(encoding="utf-8"))]
    assert len(commands) > 30  # a broken pattern would find nothing
    wrong = []
    for command in dict.fromkeys(commands):
        if re.search(r"\b(WHAT|COMMAND|EXPERIMENT)\b", command):  # a placeholder subcommand
            continue
        try:
            build_parser().parse_args(command.split()[1:])
        except SystemExit as exc:
            err = capsys.readouterr().err.strip()
            if exc.code != 0 and " required" not in err:  # --help exits 0; a name alone
                wrong.append(f"{command}: {err}")
    assert not wrong, "\n".join(wrong)
