"""The engine's boundary (worker/engine_core.py): code outside worker/engine*.py asks an
engine only what EngineCore declares, and never reaches through it into its parts
(`engine.kv.x`, `engine.runner.x`): read from the source, as the private-access check is.

An engine is recognised by name: `engine`, `self.engine`, `w.engine`..., and in the
worker's files (actor*.py, heartbeat.py) the `e` its step-thread commands receive."""

from __future__ import annotations

import ast
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("worker", "cluster", "deploy", "kernels")
WORKER_FILES = ("worker/actor", "worker/heartbeat")  # where `e` is the engine (commands: fn(e))


def declared() -> set[str]:
    tree = ast.parse(open(os.path.join(ROOT, "worker", "engine_core.py")).read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineCore")
    names = set()
    for n in cls.body:
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            names.add(n.target.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(n.name)
    return names


def outside_files() -> list[str]:
    out = []
    for pkg in PACKAGES:
        out += glob.glob(os.path.join(ROOT, pkg, "**", "*.py"), recursive=True)
    rel = [os.path.relpath(p, ROOT) for p in out]
    return sorted(p for p in rel if not os.path.basename(p).startswith("engine") and not p.endswith("_pb2.py")
                  and not p.endswith("_pb2_grpc.py"))


def is_engine(node: ast.AST, path: str) -> bool:
    if isinstance(node, ast.Name):
        return node.id == "engine" or (node.id == "e" and path.startswith(WORKER_FILES))
    return isinstance(node, ast.Attribute) and node.attr == "engine"


def engine_uses(path: str) -> list[tuple[int, str, bool]]:
    """(line, member, reached through): every `engine.member` in `path`; `reached through`
    when the member's own attribute is read (`engine.member.x`)."""
    tree = ast.parse(open(os.path.join(ROOT, path)).read(), path)
    parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    uses = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and is_engine(n.value, path):
            up = parents.get(n)
            uses.append((n.lineno, n.attr, isinstance(up, ast.Attribute) and up.value is n))
    return uses


def test_code_outside_the_engine_uses_only_what_engine_core_declares():
    members = declared()
    assert {"add_request", "step", "abort", "export_request", "import_request", "stats"} <= members
    undeclared, through = [], []
    for path in outside_files():
        for line, attr, deep in engine_uses(path):
            if attr not in members:
                undeclared.append(f"{path}:{line} engine.{attr}")
            elif deep and attr != "config":  # config is a plain value object (EngineConfig)
                through.append(f"{path}:{line} engine.{attr}.<...>")
    assert not undeclared, "not declared in EngineCore (worker/engine_core.py):\n" + "\n".join(undeclared)
    assert not through, "reaches through the engine into its parts:\n" + "\n".join(through)


def test_the_check_sees_engine_uses():
    """The scan finds the worker's uses at all (a scan that matched nothing would pass)."""
    uses = {attr for p in outside_files() if p.startswith("worker/actor") for _, attr, _ in engine_uses(p)}
    assert {"add_request", "step", "abort", "stats", "import_request"} <= uses, uses
