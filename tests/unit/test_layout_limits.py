"""STYLE.md's size habits, held by a test: no module of the packages above 300 lines and no
function above 80 (one idea per file; a function that reads in one screen)."""

from __future__ import annotations

import ast
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("worker", "cluster", "deploy", "kernels")
MAX_FILE_LINES = 300
MAX_FUNCTION_LINES = 80


def sources() -> list[str]:
    out = []
    for pkg in PACKAGES:
        out += glob.glob(os.path.join(ROOT, pkg, "**", "*.py"), recursive=True)
    return sorted(p for p in out if not p.endswith(("_pb2.py", "_pb2_grpc.py")))  # protoc's, made at install


def test_no_module_above_300_lines():
    long = {os.path.relpath(p, ROOT): n for p in sources() if (n := len(open(p).read().splitlines())) > MAX_FILE_LINES}
    assert not long, long


def test_no_function_above_80_lines():
    long = []
    for p in sources():
        for n in ast.walk(ast.parse(open(p).read(), p)):
            if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            lines = n.end_lineno - n.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                long.append(f"{os.path.relpath(p, ROOT)}:{n.lineno} {n.name} ({lines} lines)")
    assert not long, long


def test_the_limits_see_the_packages():
    assert len(sources()) > 50  # a glob that matched nothing would pass the checks above
