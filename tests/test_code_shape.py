"""The codebase stays easy to change: no function over 80 lines outside the kernels (Pallas
kernel bodies are long by nature), checked on every test run."""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
MAX_LINES = 80


def test_no_function_over_80_lines_outside_kernels():
    long = []
    for folder in ("jaxinfra", "models", "sharding", "benchmarks", "scripts"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_LINES:
                        long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "split these into smaller functions: " + "; ".join(long)
