"""The shape of the code base, checked on every test run (no jax needed for the graph checks):

(a) the import graph of our four packages has no cycles, between modules or between the units
    below, and no upward imports across the layers (docs/architecture.md, "Layout and layering");
(b) loading a run config imports no jax (so a bad config fails in a fraction of a second);
(c) no function over 60 lines outside kernels/ (Pallas kernel bodies are long by nature).

Every import counts, function-level and TYPE_CHECKING ones included: a deferred import is still
a dependency, only a later one.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "sharding", "models", "jaxinfra")
MAX_LINES = 60

# Layers, lowest first. A module may import its own layer or lower ones. Inside jaxinfra/ a
# unit is a top-level module or a subpackage; every one must be listed (a new one fails the test
# until it is placed).
CORE = ("jaxinfra", "jaxinfra.config", "jaxinfra.config_sections", "jaxinfra.exits", "jaxinfra.distributed",
        "jaxinfra.atomic", "jaxinfra.storage", "jaxinfra.rundir", "jaxinfra.watchdog", "jaxinfra.data", "jaxinfra.metrics", "jaxinfra.optim",
        "jaxinfra.loss", "jaxinfra.state", "jaxinfra.step", "jaxinfra.quant_checks", "jaxinfra.extensions",
        "jaxinfra.runtime", "jaxinfra.checkpoint", "jaxinfra.compile_cache", "jaxinfra.resume", "jaxinfra.train", "jaxinfra.flags")
FEATURES = ("jaxinfra.infer", "jaxinfra.quantize", "jaxinfra.distill", "jaxinfra.sft", "jaxinfra.lora", "jaxinfra.dpo", "jaxinfra.grpo",
            "jaxinfra.reference", "jaxinfra.hf", "jaxinfra.harness",
            "jaxinfra.plan", "jaxinfra.scaling", "jaxinfra.cluster", "jaxinfra.info", "jaxinfra.bench", "jaxinfra.launch")
TOP = ("jaxinfra.cli", "jaxinfra.data_cli", "jaxinfra.__main__")
LAYERS = {"kernels": 0, "sharding": 1, "models": 2, **dict.fromkeys(CORE, 3), **dict.fromkeys(FEATURES, 4),
          **dict.fromkeys(TOP, 5)}
LAYER_NAMES = ("kernels", "sharding", "models", "core", "features", "cli")


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _ours(name: str) -> str | None:
    """The module of ours that `import name` loads (a name inside a module resolves to the module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imported(module: str, path: pathlib.Path) -> dict[str, int]:
    """{module of ours: first line importing it} for every import statement in the file."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            # `from pkg import sub` imports the submodule; `from mod import name` the module.
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for name in names:
            target = _ours(name)
            if target and target != module:
                found.setdefault(target, node.lineno)
    return found


GRAPH = {module: _imported(module, path) for module, path in MODULES.items()}


def _unit(module: str) -> str:
    """kernels/, sharding/, models/: the module itself; jaxinfra/: its listed module or subpackage."""
    if not module.startswith("jaxinfra"):
        return module
    listed = [u for u in (*CORE, *FEATURES, *TOP) if module == u or module.startswith(u + ".")]
    return max(listed, key=len) if listed else module


def _layer(module: str) -> int | None:
    top = module.split(".")[0]
    return LAYERS[top] if top != "jaxinfra" else LAYERS.get(_unit(module))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _describe(cycle: list[str], graph: dict[str, set[str]]) -> str:
    edges = [f"{a} -> {b}" for a in cycle for b in sorted(graph[a]) if b in cycle]
    return "{" + ", ".join(edges) + "}"


def test_every_jaxinfra_module_has_a_layer():
    unplaced = sorted({_unit(m) for m in MODULES if _layer(m) is None})
    assert not unplaced, f"place these in CORE, FEATURES or TOP of tests/test_layout.py: {unplaced}"


def test_no_upward_imports():
    upward = []
    for module, targets in GRAPH.items():
        for target, line in targets.items():
            here, there = _layer(module), _layer(target)
            if here is not None and there is not None and there > here:
                upward.append(f"{MODULES[module].relative_to(REPO)}:{line} {module} ({LAYER_NAMES[here]}) imports "
                              f"{target} ({LAYER_NAMES[there]})")
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_no_import_cycles_between_modules():
    graph = {m: set(t) for m, t in GRAPH.items()}
    cycles = _cycles(graph)
    assert not cycles, "module import cycles: " + "; ".join(_describe(c, graph) for c in cycles)


def test_no_import_cycles_between_units():
    graph: dict[str, set[str]] = {}
    for module, targets in GRAPH.items():
        unit = _unit(module)
        graph.setdefault(unit, set()).update(u for u in map(_unit, targets) if u != unit)
    cycles = _cycles(graph)
    assert not cycles, "package-level import cycles: " + "; ".join(_describe(c, graph) for c in cycles)


def test_the_graph_checks_see_what_they_should():
    # Guards against a parser that silently finds nothing: known edges, function-level ones too.
    assert "jaxinfra.config" in GRAPH["jaxinfra.cli"]
    assert "jaxinfra.launch" in GRAPH["jaxinfra.cli"]  # imported inside cmd_launch
    assert "kernels" in GRAPH["sharding.context"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_loading_a_config_imports_no_jax():
    code = ("import sys, jaxinfra.config as c\n"
            "assert 'jax' not in sys.modules, 'import jaxinfra.config loaded jax'\n"
            "c.load_config('tiny', ['mesh.stage=2', 'mesh.data=-1'])\n"
            "heavy = sorted(m for m in ('jax', 'flax', 'optax', 'orbax', 'grain') if m in sys.modules)\n"
            "assert not heavy, f'load_config loaded {heavy}'\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_package_inits_import_no_jax():
    # A package that re-exports jax-heavy names loads them on first use (PEP 562 __getattr__), so
    # importing any jax-free module below it stays jax-free. Checked one package after another:
    # the first after which jax is loaded is the culprit.
    packages = sorted(m for m, path in MODULES.items() if path.name == "__init__.py")
    code = ("import importlib, sys\n"
            f"for name in {packages!r}:\n"
            "    importlib.import_module(name)\n"
            "    assert 'jax' not in sys.modules, f'importing package {name} loaded jax'\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_no_function_over_60_lines_outside_kernels():
    long = []
    for folder in ("jaxinfra", "models", "sharding", "scripts", "benchmarks", "tests"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_LINES:
                        long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "split these into smaller functions: " + "; ".join(long)
