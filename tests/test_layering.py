"""The package's layers (issue 34): ``fedbasin.alignment`` imports nothing of fedbasin's data,
models, training, Flower apps or simulations, nor Flower itself, and no two fedbasin modules import
each other (an import cycle, at module level or inside functions), read from the source with ``ast``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fedbasin"
#: what the alignment core must not import (directly or in a function)
FORBIDDEN = ("fedbasin.data", "fedbasin.models", "fedbasin.training", "fedbasin.server", "fedbasin.client",
             "fedbasin.strategies", "fedbasin.benchmarks", "fedbasin.cli", "flwr")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported(path: Path, top_level_only: bool) -> set[str]:
    """The modules ``path`` imports (relative imports resolved; ``from a import b`` names ``a.b``
    when that is a fedbasin module, else ``a``), at module level only or anywhere in the file."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    nodes = ast.parse(path.read_text()).body if top_level_only else ast.walk(ast.parse(path.read_text()))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package
                for _ in range(node.level - 1):
                    parent = parent.rpartition(".")[0]
                base = f"{parent}.{base}" if base else parent
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in MODULES else base)
    return found


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_alignment_imports_no_data_models_training_or_flower():
    alignment = [name for name in MODULES if name == "fedbasin.alignment" or name.startswith("fedbasin.alignment.")]
    assert len(alignment) > 10
    bad = sorted((name, target) for name in alignment for target in imported(MODULES[name], top_level_only=False)
                 if any(target == f or target.startswith(f + ".") for f in FORBIDDEN))
    assert bad == []


def test_importing_alignment_loads_no_flower_and_no_data():
    code = ("import sys, fedbasin.alignment, fedbasin.alignment.hf\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'flwr' or m.startswith(("
            + ", ".join(repr(f) for f in FORBIDDEN if f != "flwr") + "))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"



def test_the_product_imports_no_benchmark():
    """The benchmark and experiment drivers (``fedbasin.benchmarks``) sit apart from the product: no
    other fedbasin module imports them (the main job, ``fedbasin.simulate``, included)."""
    product = [name for name in MODULES if not name.startswith("fedbasin.benchmarks")]
    assert "fedbasin.simulate" in product and "fedbasin.cli" in product
    bad = sorted((name, target) for name in product for target in imported(MODULES[name], top_level_only=False)
                 if target.startswith("fedbasin.benchmarks"))
    assert bad == []

@pytest.mark.parametrize("top_level_only", [True, False])
def test_no_import_cycles(top_level_only):
    """None at module level, and none through imports inside functions either (a lazy import that
    closes a cycle only hides it: ``cli`` ↔ ``simulate`` was one)."""
    graph = {name: {t for t in imported(path, top_level_only) if t in MODULES and t != name}
             for name, path in MODULES.items()}
    assert import_cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]


def test_the_apps_share_only_what_preload_imports_first():
    """Flower's simulation imports the ServerApp and the ClientApp in two threads of one process.
    ``fedbasin.preload`` (imported first by ``fedbasin.server`` and ``fedbasin.client``) loads every
    fedbasin module both apps need and none of either app's package: after it, the two apps
    import disjoint sets of modules, so the two threads never wait on each other's locks (an
    import deadlock otherwise, ``_DeadlockError``, seen in about one simulation in ten)."""
    def loaded_after_preload(app: str) -> tuple[list, list]:
        code = ("import sys\n"
                "import fedbasin.preload\n"
                "before = {m for m in sys.modules if m.startswith('fedbasin')}\n"
                f"import {app}\n"
                "print(sorted(before))\n"
                "print(sorted({m for m in sys.modules if m.startswith('fedbasin')} - before))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
        return [ast.literal_eval(line) for line in out.stdout.strip().splitlines()[-2:]]

    preloaded, server = loaded_after_preload("fedbasin.server.server_app")
    _, client = loaded_after_preload("fedbasin.client.client_app")
    assert not [m for m in preloaded if m.startswith(("fedbasin.server", "fedbasin.client"))]
    assert "fedbasin.server.server_app" in server and "fedbasin.client.client_app" in client
    assert set(server).isdisjoint(client), sorted(set(server) & set(client))
    for package in ("server", "client"):  # preload comes first in each app package
        first = next(n for n in ast.parse((PACKAGE / package / "__init__.py").read_text()).body
                     if isinstance(n, (ast.Import, ast.ImportFrom)))
        assert isinstance(first, ast.ImportFrom) and first.module == "fedbasin" and first.names[0].name == "preload"
