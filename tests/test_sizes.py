"""Small modules, small functions: modules under ~400 lines, functions under ~60.

The limits below leave a little slack around those figures. Where a module or function
must be longer, a comment says why: ``# long: <reason>`` on the ``def`` line (or the line
above it), or in the module's first 5 lines for a whole module.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tokenlake", "query_engine", "transfer_engine", "scheduler", "evals")
MODULE_LINES = 420
FUNCTION_LINES = 65


def _sources():
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            yield path, path.read_text(encoding="utf-8")


def test_modules_are_small():
    big = []
    for path, text in _sources():
        lines = text.splitlines()
        if len(lines) > MODULE_LINES and not any("# long:" in line for line in lines[:5]):
            big.append(f"{path.relative_to(ROOT)}: {len(lines)} lines")
    assert not big, big


def test_functions_are_small():
    big = []
    for path, text in _sources():
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            length = node.end_lineno - node.lineno + 1
            near = lines[max(0, node.lineno - 2): node.lineno]
            if length > FUNCTION_LINES and not any("# long:" in line for line in near):
                big.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines")
    assert not big, big
