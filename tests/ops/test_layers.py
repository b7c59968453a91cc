"""The import graph between pagedq's packages: each imports only the packages below it, so there is no cycle.

Every import statement counts, those inside functions and under TYPE_CHECKING too: a lazy import is still a
dependency, only a cheaper one.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Package -> the packages of ours it may import. From the top: the command line; the benchmarks; the HTTP front;
# the worker; the operator views; the engine; its kernels; the producer (the protocol and the clients).
ALLOWED = {
    "cli": {"bench", "serve", "worker", "monitor", "engine", "kernels", "producer"},
    "bench": {"serve", "worker", "monitor", "engine", "kernels", "producer"},
    "serve": {"monitor", "producer"},
    "worker": {"engine", "producer"},
    "monitor": {"producer"},
    "engine": {"kernels"},
    "kernels": set(),
    "producer": set(),
}


def _packages() -> set[str]:
    return {p.parent.name for p in ROOT.glob("*/__init__.py")}


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


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
