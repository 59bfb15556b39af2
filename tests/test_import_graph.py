# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The import graph of vllm/, read statically (ast): no import circle, and no arrow from a lower
layer back up (config -> models / engine / entrypoints, models -> v1 / entrypoints, the package
face -> entrypoints at import time). Imports under `if TYPE_CHECKING:` are annotations only and
do not count; imports inside functions do (a lazy import is still a dependency), except a package
face's lazy exports (an `__init__.py`'s module `__getattr__`, as upstream vLLM's `vllm.LLM`).
Importing `a.b.c` runs `a/b/__init__.py` first, so it is an arrow to that package face too (the
root `vllm` face aside: everything imports it)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "vllm"

# (importer prefix, imported prefix, why the arrow may not exist)
FORBIDDEN = [
    ("vllm.config", "vllm.model_executor", "config imports no model module"),
    ("vllm.config", "vllm.models", "config imports no model module"),
    ("vllm.config", "vllm.v1", "config sits below the engine"),
    ("vllm.config", "vllm.engine", "config sits below EngineArgs"),
    ("vllm.config", "vllm.entrypoints", "config sits below the entrypoints"),
    ("vllm.model_executor", "vllm.v1", "models and layers sit below the engine and worker"),
    ("vllm.model_executor", "vllm.entrypoints", "models sit below the entrypoints"),
    ("vllm.models", "vllm.v1", "models sit below the engine and worker"),
    ("vllm.models", "vllm.entrypoints", "models sit below the entrypoints"),
    ("vllm.attention", "vllm.model_executor", "the attention backends sit below the layers"),
    ("vllm.attention", "vllm.v1", "the attention backends sit below the worker"),
    ("vllm.v1", "vllm.entrypoints", "the engine sits below the entrypoints"),
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, name: str, modules: dict[str, Path]) -> list[tuple[str, bool]]:
    """(imported vllm module, at import time?) for every import of the file that runs."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found: list[tuple[str, bool]] = []

    def resolve(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    def visit(node: ast.AST, top_level: bool, func: str | None) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child, top_level, func)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("vllm"):
                    target = resolve(alias.name)
                    if target is not None:
                        found.append((target, top_level))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.startswith("vllm") and not (is_pkg and func == "__getattr__"):
                for alias in node.names:
                    target = resolve(f"{mod}.{alias.name}")
                    if target is not None:
                        found.append((target, top_level))
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                for grandchild in child.body:
                    visit(grandchild, False, child.name if func is None else func)
            else:
                visit(child, top_level, func)

    visit(ast.parse(path.read_text(), str(path)), True, None)
    return found


@functools.cache
def _graph() -> dict[str, dict[str, bool]]:
    """importer -> {imported: imported at import time}; the package faces a module lives in
    are not arrows of its own."""
    modules = _modules()
    graph: dict[str, dict[str, bool]] = {}
    for name, path in modules.items():
        edges: dict[str, bool] = {}
        for target, top in _imports(path, name, modules):
            parts = target.split(".")
            for i in range(2, len(parts) + 1):  # the package faces on the way, then the target
                dst = ".".join(parts[:i])
                if dst not in modules or dst == name or name.startswith(dst + "."):
                    continue
                edges[dst] = edges.get(dst, False) or top
        graph[name] = edges
    return graph


def _circles(graph: dict[str, dict[str, bool]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_graph_is_read():
    graph = _graph()
    assert "vllm.v1.worker.gpu.model_runner" in graph
    assert "vllm.config" in graph["vllm.v1.engine.llm_engine"] or any(
        _within(t, "vllm.config") for t in graph["vllm.v1.engine.llm_engine"]
    )


def test_no_import_circle():
    circles = _circles(_graph())
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


@pytest.mark.parametrize(("importer", "imported", "why"), FORBIDDEN)
def test_no_arrow_back_up(importer: str, imported: str, why: str):
    bad = [
        f"{src} -> {dst}"
        for src, edges in _graph().items()
        if _within(src, importer)
        for dst in edges
        if _within(dst, imported)
    ]
    assert not bad, f"{why}:\n" + "\n".join(bad)


def test_package_face_imports_no_entrypoint():
    """`import vllm` must not import the entrypoints (the server's and LLM's dependencies):
    `LLM` is a lazy export."""
    eager = [
        dst for dst, top in _graph()["vllm"].items() if top and _within(dst, "vllm.entrypoints")
    ]
    assert not eager, eager
