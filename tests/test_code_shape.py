"""What the code promises of its own shape (issue 37): functions a reader takes in at a glance, and services that
know nothing of the command line."""

from __future__ import annotations

import ast
from pathlib import Path

import ptq_cli

PACKAGE = Path(ptq_cli.__file__).parent
# Lines from a function's def to its last line: longer, it does more than one thing; split it.
MAX_FUNCTION_LINES = 50
CLI_LIBRARIES = ("typer", "rich", "click")


def _modules() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text(), str(path))) for path in sorted(PACKAGE.rglob("*.py"))]


def test_no_function_is_over_fifty_lines():
    long = [f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path, tree in _modules() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, long


# Lines in one module: past it, a module holds more than one concern (a reader's map of the house stops working).
MAX_MODULE_LINES = 700


def test_no_module_is_over_seven_hundred_lines():
    long = [f"{path.relative_to(PACKAGE)} ({lines} lines)" for path, _ in _modules()
            if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not long, long


def test_services_backends_and_datasets_never_import_the_command_line_libraries():
    found = []
    for path, tree in _modules():
        if path.relative_to(PACKAGE).parts[0] == "cli" or path.name in ("render.py", "render_report.py"):
            continue
        for node in ast.walk(tree):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.relative_to(PACKAGE)}: {name}" for name in names if name.split(".")[0] in CLI_LIBRARIES]
    assert not found, found
