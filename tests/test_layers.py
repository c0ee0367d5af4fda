"""The package's import arrows point down: tree -> ops -> cp -> megatron -> training/data -> cli.

Every import statement of every module (top level and inside functions) is resolved to the
``megatron_tree`` sub-package it names and checked against the allowed arrows. A Megatron user
swaps in ``megatron_tree.megatron``; it must never pull in our data pipeline or our application.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import megatron_tree

ROOT = Path(megatron_tree.__file__).parent

# Layer -> the layers of ours it may import (itself always allowed). ``compat`` holds the version
# shims (beside ops: the DSA Hadamard fallback calls an op); ``cpu`` is the CPU layer (Megatron on a
# CPU host: tests, the CPU recipes, the launcher's CPU path), whose torch stand-ins call the ops and
# which the extension asks for only on a host without CUDA.
ALLOWED = {
    "tree": set(),
    "ops": {"tree"},
    "compat": {"tree", "ops"},
    "cpu": {"tree", "ops", "compat"},
    "cp": {"tree", "ops"},
    "megatron": {"tree", "ops", "cp", "compat", "cpu"},
    "data": {"tree"},
    "viz": {"tree"},
    "training": {"tree", "ops", "cp", "compat", "cpu", "megatron", "data", "bridge"},
    "rl": {"tree", "ops", "cp", "compat", "cpu", "megatron", "data"},  # the RL frameworks' API (beside training)
    "bridge": {"tree", "ops", "cp", "compat", "cpu", "megatron"},  # Megatron-Bridge / HF checkpoints (optional extra)
    "cli": {"tree", "ops", "cp", "compat", "cpu", "megatron", "data", "training", "viz", "bridge"},
    "__main__": {"cli"},
    "__init__": set(),
}


def _layer(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _module_name(path: Path) -> str:
    """``megatron_tree.a.b`` for ``a/b.py`` and for ``a/b/__init__.py``."""
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(path: Path) -> set[tuple[str, int]]:
    """(dotted name, line) for every import of a ``megatron_tree`` name in ``path`` (top level and
    inside functions); ``from pkg import x`` yields ``pkg.x`` (a module or a name of ``pkg``)."""
    rel = path.relative_to(ROOT.parent).with_suffix("")
    package = list(rel.parts[:-1])  # a module and a package's __init__ resolve "." alike
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names = [mod + "." + a.name for a in node.names]
        out.update((n, node.lineno) for n in names if n.startswith("megatron_tree."))
    return out


def _imported_layers(path: Path) -> set[tuple[str, int]]:
    """(layer, line) for every import of a ``megatron_tree`` module in ``path``."""
    return {(name.split(".")[1], line) for name, line in _imported_modules(path)}


def _import_graph(paths) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports. A dotted name resolves to the longest module it
    starts with (``from megatron_tree.cp import CPPlan`` is an arrow to the package ``megatron_tree.cp``)."""
    names = {_module_name(p): p for p in paths}

    def resolve(name):
        parts = name.split(".")
        while parts and ".".join(parts) not in names:
            parts.pop()
        return ".".join(parts)

    return {me: {t for t in (resolve(n) for n, _ in _imported_modules(p)) if t and t != me}
            for me, p in names.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root), on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w), on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
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
    return out


def _modules():
    return sorted(p for p in ROOT.rglob("*.py"))


def test_every_module_has_a_layer():
    layers = {_layer(p) for p in _modules()}
    assert layers <= set(ALLOWED), layers - set(ALLOWED)
    assert {"tree", "ops", "megatron", "training", "data"} <= layers


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down(path):
    me = _layer(path)
    bad = sorted((layer, line) for layer, line in _imported_layers(path) if layer != me and layer not in ALLOWED[me])
    assert not bad, f"{path.relative_to(ROOT.parent)} ({me}) imports upward: " + ", ".join(
        f"megatron_tree.{layer} at line {line}" for layer, line in bad)


def test_no_import_circle():
    """No two modules of ours import each other, directly or around a loop, counting imports inside
    functions too (a deferred import hides a circle from Python, not from a reader)."""
    circles = _circles(_import_graph(_modules()))
    assert not circles, "import circles: " + "; ".join(" -> ".join(c + c[:1]) for c in circles)


def test_circle_checker_finds_a_planted_loop():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}, "f": {"f"}}
    assert _circles(graph) == [["a", "b", "c"]]
    graph["d"] = {"e"}
    assert sorted(_circles(graph)) == [["a", "b", "c"], ["d", "e"]]


def _imports_torch_distributed(path: Path) -> list[int]:
    """Lines of ``path`` that import ``torch.distributed`` (any form, inside functions too)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            hit = any(a.name == "torch.distributed" or a.name.startswith("torch.distributed.") for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            mod = node.module or ""
            hit = mod == "torch.distributed" or mod.startswith("torch.distributed.") or (
                mod == "torch" and any(a.name == "distributed" for a in node.names))
        else:
            hit = False
        if hit:
            lines.append(node.lineno)
    return lines


def test_cp_has_two_rooms_and_the_plan_never_reaches_the_process_group():
    """``cp/`` holds the plan (``cp/planning``: host-side, identical on every rank) and the execution
    (``cp/execution``: collectives); nothing else. The planning half, and every module of ours it
    imports (transitively), imports no ``torch.distributed`` and nothing of the execution half."""
    cp = ROOT / "cp"
    loose = sorted(p.name for p in cp.glob("*.py") if p.name != "__init__.py")
    assert not loose, f"cp/ modules outside planning/ and execution/: {loose}"
    assert {p.name for p in cp.iterdir() if p.is_dir() and p.name != "__pycache__"} == {"planning", "execution"}
    paths = {_module_name(p): p for p in _modules()}
    graph = _import_graph(_modules())
    planning = sorted(n for n in paths if n.startswith("megatron_tree.cp.planning"))
    assert len(planning) > 5
    seen, todo = set(), list(planning)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(graph[n] - {"megatron_tree.cp"})  # the package's lazy re-exports import nothing
    bad = sorted(n for n in seen if n.startswith(("megatron_tree.cp.execution", "megatron_tree.megatron",
                                                  "megatron_tree.training", "megatron_tree.compat", "megatron_tree.cpu")))
    assert not bad, f"cp.planning reaches {bad}"
    dist = {n: _imports_torch_distributed(paths[n]) for n in sorted(seen)}
    dist = {n: lines for n, lines in dist.items() if lines}
    assert not dist, f"cp.planning reaches torch.distributed: {dist}"
    # the execution half is where the collectives are (the check above is not vacuous)
    assert _imports_torch_distributed(ROOT / "cp" / "execution" / "comm.py")
    code = ("import sys\nimport megatron_tree.cp.planning as p\n"
            "for n in p.__all__: getattr(p, n)\n"
            "bad = [k for k in sys.modules if k.startswith('megatron_tree.cp.execution')]\n"
            "assert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_checker_sees_relative_and_inner_imports(tmp_path, monkeypatch):
    """The checker itself: a planted function-level relative import of the application is found."""
    fake = ROOT / "megatron" / "model.py"
    src = "def f():\n    from ..training.verify import run_verify\n    from ..data import pipeline\n"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: src)
    found = _imported_layers(fake)
    assert ("training", 2) in found and ("data", 3) in found


def test_extension_import_loads_no_application():
    """Importing every extension module loads neither ``megatron_tree.data`` nor ``.training``."""
    code = ("import sys\n"
            "from megatron_tree.cpu import megatron_core as cpu\n"
            "cpu.enable(kernels=True)  # Megatron's Mamba mixer imports Triton kernels; stand-ins on CPU\n"
            "import megatron_tree.megatron as m\n"
            "for n in m.__all__: getattr(m, n)\n"
            "bad = [k for k in sys.modules if k.startswith(('megatron_tree.data', 'megatron_tree.training'))]\n"
            "assert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_architecture_document_is_in_the_repository_and_names_every_layer():
    doc = ROOT.parent / "docs" / "architecture.md"
    readme = (ROOT.parent / "README.md").read_text()
    assert "(docs/architecture.md)" in readme and "../shared" not in readme
    text = doc.read_text()
    for layer in sorted({_layer(p) for p in ROOT.glob("*/__init__.py")}):
        assert f"**`{layer}/`**" in text, f"docs/architecture.md has no paragraph on megatron_tree/{layer}/"
