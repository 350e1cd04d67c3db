"""The package layout stays as documented: no import cycle between torch_gradops' modules (imports
inside functions included), and tests, benchmarks and examples use public modules only."""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "torch_gradops")


def _modules():
    """module name -> file, for every .py file of the package."""
    found = {}
    for folder, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), ROOT)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                found[".".join(rel)] = os.path.join(folder, f)
    return found


def _imports(name, path, modules):
    """Every torch_gradops module ``name`` imports anywhere in its file."""
    tree = ast.parse(open(path).read())
    is_pkg = path.endswith("__init__.py")
    out = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[:len(base) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import sub` imports the submodule when there is one
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
        for t in targets:
            while t and t not in modules:  # `import a.b.c` of a name inside a module
                t = t.rpartition(".")[0]
            # a module's own ancestor packages are initialised before it anyway: no edge
            if t and t != name and not name.startswith(t + "."):
                out.add(t)
    return out


def test_no_import_cycle():
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    state = {}

    def visit(m, stack):
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycle = stack[stack.index(n):] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n, stack + [n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_distributed_uses_tensornet_never_the_reverse():
    modules = _modules()
    for m, p in modules.items():
        if m.startswith("torch_gradops.tensornet"):
            assert not any(t.startswith("torch_gradops.distributed") for t in _imports(m, p, modules)), m


@pytest.mark.parametrize("folder", ["tests", "benchmarks", "examples"])
def test_no_private_imports_outside_the_package(folder):
    bad = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
        for f in files:
            if not f.endswith(".py"):
                continue
            tree = ast.parse(open(os.path.join(dirpath, f)).read())
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch_gradops"):
                    names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                for n in names:
                    parts = n.split(".")
                    if parts[0] == "torch_gradops" and any(p.startswith("_") for p in parts[1:]):
                        bad.append(f"{folder}/{f}: {n}")
    assert not bad, bad


def test_demo_is_imported_by_nothing_outside_it():
    modules = _modules()
    for m, p in modules.items():
        if not m.startswith("torch_gradops.demo"):
            assert not any(t.startswith("torch_gradops.demo") for t in _imports(m, p, modules)), m


@pytest.mark.parametrize("script", sorted(f for f in os.listdir(os.path.join(ROOT, "benchmarks"))
                                          if f.endswith(".py") and not f.startswith("_")))
def test_benchmark_scripts_import(script):
    """Each benchmark's module level (its imports from the package and benchmarks/_common) loads:
    a renamed helper must not break a script nobody runs in CI."""
    import importlib.util
    import sys
    path = os.path.join(ROOT, "benchmarks", script)
    sys.path.insert(0, os.path.dirname(path))
    try:
        spec = importlib.util.spec_from_file_location(f"_bench_{script[:-3]}", path)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    finally:
        sys.path.remove(os.path.dirname(path))
