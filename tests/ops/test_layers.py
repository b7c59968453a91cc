"""The import graph: between pagedq's packages (each imports only the packages below it) and between the modules
inside each package (no cycle, in any folder).

Every import statement counts, those inside functions and under TYPE_CHECKING too: a lazy import is still a
dependency, only a cheaper one, and hiding a cycle behind one keeps the cycle.

Between modules, an edge goes to the module an import names: `import pkg.sub.mod` and `from pkg.sub.mod import x`
to pkg.sub.mod; `from pkg.sub import name` to pkg.sub.name where that is a module, else to pkg/sub/__init__.py;
relative imports resolved the same way. The parents that Python imports on the way (pkg, pkg.sub) are not edges:
every module would otherwise be in a cycle with the __init__ of its own package, which imports any of its modules.
An __init__ is a module like the others: what it re-exports are edges from it (engine/__init__.py -> engine.config),
so a module that imports a name through its package's __init__ and is itself re-exported there closes a cycle and
is named by the test; import the name from the module that owns it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Package -> the packages of ours it may import. From the top: the command line; the benchmarks; the HTTP front;
# the worker; the operator views; the engine; its kernels; the producer (the protocol and the clients).
ALLOWED = {
    "cli": {"bench", "serve", "worker", "monitor", "engine", "pagedq_kernels", "producer"},
    "bench": {"serve", "worker", "monitor", "engine", "pagedq_kernels", "producer"},
    "serve": {"monitor", "producer"},
    "worker": {"engine", "producer"},
    "monitor": {"producer"},
    "engine": {"pagedq_kernels"},
    "pagedq_kernels": set(),
    "producer": set(),
}


# Top-level names that other distributions install: a package of ours by one of these names would share a folder in
# site-packages with theirs, and whichever is installed later overwrites the other's files. Hugging Face's `kernels`,
# which transformers 5.25 requires, did that to our kernels package (now pagedq_kernels) in a fresh image.
TAKEN = {"kernels"}


def _packages() -> set[str]:
    return {p.parent.name for p in ROOT.glob("*/__init__.py")}


def _module(path: Path) -> str:
    """engine/runner/sampler.py -> engine.runner.sampler; engine/__init__.py -> engine."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def _installed_top_levels() -> dict[str, str]:
    """Top-level package or module name -> the installed distribution (other than ours) that provides it."""
    import importlib.metadata

    found = {}
    for dist in importlib.metadata.distributions():
        if (dist.metadata["Name"] or "").lower() == "pagedq":
            continue
        for line in (dist.read_text("top_level.txt") or "").split():
            found[line] = dist.metadata["Name"]
        for file in dist.files or ():
            if len(file.parts) > 1 and file.parts[-1] == "__init__.py":
                found[file.parts[0]] = dist.metadata["Name"]
    return found


def test_no_other_distribution_installs_a_package_of_ours():
    installed = _installed_top_levels()
    clashes = {name: installed.get(name, "a known distribution (TAKEN)") for name in _packages()
               if name in installed or name in TAKEN}
    assert not clashes, f"packages of ours whose names other distributions install too: {clashes}"


def test_every_package_has_its_place():
    assert _packages() == set(ALLOWED), "a package of ours must be given its allowed imports in ALLOWED"


def test_imports_point_down_only():
    ours = set(ALLOWED)
    wrong = []
    for package, allowed in ALLOWED.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            for line, module in _imports(path):
                top = module.split(".")[0]
                if top in ours and top != package and top not in allowed:
                    wrong.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not wrong, "imports against the layers (tests/ops/test_layers.py, ALLOWED):\n" + "\n".join(wrong)


def test_the_allowed_directions_have_no_cycle():
    order: list[str] = []
    while len(order) < len(ALLOWED):
        ready = [p for p, deps in ALLOWED.items() if p not in order and deps <= set(order)]
        assert ready, f"a cycle among {sorted(set(ALLOWED) - set(order))}"
        order += ready


def _targets(path: Path, node: ast.Import | ast.ImportFrom, modules: set[str]) -> list[str]:
    """The modules of ours one import statement reaches (see the module's docstring)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in modules]
    base = node.module or ""
    if node.level:  # relative: from the importing module's package, up level - 1 more
        package = _module(path).split(".") if path.name == "__init__.py" else _module(path).split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
    named = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
    rest = len(named) < len(node.names)
    return named + ([base] if rest and base in modules else [])


def module_graph() -> dict[str, set[str]]:
    """module -> the modules of ours it imports, for every .py file in a package of ours."""
    paths = {_module(p): p for package in ALLOWED for p in sorted((ROOT / package).rglob("*.py"))}
    graph: dict[str, set[str]] = {m: set() for m in paths}
    for module, path in paths.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[module] |= {t for t in _targets(path, node, set(paths)) if t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected group of more than one module (Tarjan's algorithm): the shortest cycle from its first
    module, in import order, then the group's other modules (in other cycles through the same ones), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    found = []
    for group in groups:
        cycle = _one_cycle(graph, group)
        found.append(cycle + sorted(group - set(cycle)))
    return sorted(found)


def _one_cycle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A path inside `group` from its first module back to it (breadth-first: the shortest)."""
    start = min(group)
    came: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came[path[-1]])
                    return path[::-1]
                if w not in came:
                    came[w] = v
                    nxt.append(w)
        frontier = nxt
    return [start]


def test_no_cycle_between_modules():
    graph = module_graph()
    lines = []
    for group in cycles(graph):
        cycle = _one_cycle(graph, set(group))
        rest = group[len(cycle):]
        lines.append(" -> ".join(cycle + cycle[:1]) + (f" (and through {', '.join(rest)})" if rest else ""))
    assert not lines, "import cycles between modules (each imports the next):\n" + "\n".join(lines)


def test_the_cycle_finder_names_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"p": {"q"}, "q": {"p"}, "r": {"p"}}) == [["p", "q"]]
    # llama -> checkpoint -> llama is the shortest; quantized closes a second cycle through checkpoint
    knot = {"llama": {"checkpoint"}, "checkpoint": {"llama", "quantized"}, "quantized": {"checkpoint"}}
    assert cycles(knot) == [["checkpoint", "llama", "quantized"]]


def test_an_import_is_an_edge_to_the_module_it_names():
    modules = {"engine", "engine.config", "engine.runner", "engine.runner.sampler", "engine.runner.staging"}
    path = ROOT / "engine" / "runner" / "sampler.py"

    def edges(code: str) -> list[str]:
        return [t for node in ast.walk(ast.parse(code)) if isinstance(node, (ast.Import, ast.ImportFrom))
                for t in _targets(path, node, modules)]

    assert edges("import engine.runner.staging") == ["engine.runner.staging"]
    assert edges("from engine.runner import staging") == ["engine.runner.staging"]
    assert edges("from engine.runner import Staging") == ["engine.runner"]  # a name its __init__ gives
    assert edges("from engine import EngineConfig") == ["engine"]
    assert edges("from . import staging") == ["engine.runner.staging"]
    assert edges("from ..config import EngineConfig") == ["engine.config"]
    assert edges("def f():\n    import engine.runner.staging") == ["engine.runner.staging"]  # lazy: an edge still
    assert edges("import numpy") == []


# The engine's rooms -> the engine modules they may import (besides their own room's and kernels). The core (the flat
# modules: llm_engine and its stages, scheduler, block manager, sequence...) may import every room; the rooms below
# it only what is listed, so a weights loader or a grammar never reaches back into the step loop.
CORE_DATA = {"engine.config", "engine.scheduler", "engine.sequence", "engine.sampling_params", "engine.stats",
             "engine.block_tables"}
ROOMS = {
    "weights": set(),
    "structured": set(),
    "parallel": {"engine.config"},
    "models": {"engine.weights", "engine.parallel"},
    "runner": {"engine.models", "engine.weights", "engine.parallel", *CORE_DATA},
    # A draft model (speculative.draft) runs on a runner of its own, loaded as the target is.
    "speculative": {*CORE_DATA, "engine.block_manager", "engine.runner", "engine.weights"},
}


def _allowed_in_room(target: str, allowed: set[str]) -> bool:
    return any(target == a or target.startswith(a + ".") for a in allowed)


def test_every_engine_room_has_its_place():
    rooms = {p.parent.name for p in (ROOT / "engine").glob("*/__init__.py")}
    assert rooms == set(ROOMS), "a room of engine/ must be given its allowed imports in ROOMS"


def test_engine_rooms_import_only_what_they_may():
    graph = module_graph()
    wrong = []
    for room, allowed in ROOMS.items():
        own = f"engine.{room}"
        for module in sorted(m for m in graph if m == own or m.startswith(own + ".")):
            for target in sorted(graph[module]):
                inside = target.startswith("engine") and not _allowed_in_room(target, {own, *allowed})
                if inside:
                    wrong.append(f"{module} imports {target}")
    assert not wrong, "engine rooms importing against ROOMS (tests/ops/test_layers.py):\n" + "\n".join(wrong)
