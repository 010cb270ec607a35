"""House limits on size: no module of the package over 500 lines, no function on the fetch
path over 60 lines (STYLE.md; issue 15)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tensorwire"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60
# What a fetch runs through: the runtime's get, the agent and its dispatch, every transport.
FETCH_PATH = [
    PACKAGE / "runtime" / "api.py",
    PACKAGE / "runtime" / "ref.py",
    *sorted((PACKAGE / "transport").glob("*.py")),
]


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_the_package_has_modules_to_check():
    names = {p.name for p in _modules()}
    assert {"agent.py", "fetch.py", "store.py", "holders.py", "service.py", "peer_client.py"} <= names


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_is_at_most_500_lines(path: Path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, (
        f"{path.relative_to(PACKAGE)} has {lines} lines (limit {MAX_MODULE_LINES}): split it"
    )


@pytest.mark.parametrize("path", FETCH_PATH, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_functions_on_the_fetch_path_are_at_most_60_lines(path: Path):
    tree = ast.parse(path.read_text())
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines, line {node.lineno})"
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"{path.relative_to(PACKAGE)}: functions over {MAX_FUNCTION_LINES} lines: {', '.join(long)}"
