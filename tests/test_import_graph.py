"""The package's layering, checked on its source: every import (top-level or inside a
function, absolute or relative) between ``mini_paged_attn``'s subpackages points down the
order of docs/architecture.md, so the graph has no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "mini_paged_attn"
ROOT = "mini_paged_attn/__init__.py"

# docs/architecture.md's table: a unit may import units of a lower layer only (and itself).
# ``distributed`` shares ops' layer but neither imports the other.
LAYERS = {
    "errors": 0,
    "lazy_exports": 0,
    "core": 1,
    "cache": 2,
    "ops": 3,
    "distributed": 3,
    "models": 4,
    "engine": 5,
    # The package root re-exports core's, cache's, ops' and the engine's public names (each
    # on first use), so it sits above the engine and below the server and the command line.
    ROOT: 5.5,
    "server": 6,
    "commands": 7,
    "cli": 7,
}
# integrations/ is a leaf beside the stack: it imports ops/ (and what ops/ stands on) only,
# and nothing imports it but the command line.
LEAF = {"integrations": {"errors", "core", "cache", "ops"}}
LEAF_USERS = {ROOT, "commands", "cli"}


def unit_of(parts: tuple[str, ...]) -> str | None:
    """``("mini_paged_attn", "ops", "decode")`` -> ``"ops"``; ``("mini_paged_attn",)`` -> the
    root; anything outside the package -> None."""
    if not parts or parts[0] != "mini_paged_attn":
        return None
    return parts[1] if len(parts) > 1 else ROOT


def is_module(parts: tuple[str, ...], root: Path) -> bool:
    """Whether dotted ``parts`` name a module or package of ours (not a name inside one)."""
    path = root.parent.joinpath(*parts)
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def module_parts(path: Path, root: Path = PACKAGE_ROOT) -> tuple[str, ...]:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = tuple(rel.parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def imported_modules(path: Path, root: Path = PACKAGE_ROOT) -> list[tuple[tuple[str, ...], int]]:
    """Every module ``path`` imports, as dotted parts, with its line: ``import a.b``,
    ``from a import b`` (both ``a`` and ``a.b``: ``b`` may be a module) and relative forms,
    resolved against the file's package. Walks the whole tree, so imports inside functions
    and ``if TYPE_CHECKING`` blocks count too."""
    here = module_parts(path, root)
    package = here if path.name == "__init__.py" else here[:-1]
    found: list[tuple[tuple[str, ...], int]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found.extend((tuple(alias.name.split(".")), node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                assert len(base) >= 1, f"{path}:{node.lineno}: relative import above the package"
            else:
                base = ()
            target = base + (tuple(node.module.split(".")) if node.module else ())
            found.append((target, node.lineno))
            found.extend((target + (alias.name,), node.lineno) for alias in node.names
                         if is_module(target + (alias.name,), root))
    return found


def unit_edges() -> dict[tuple[str, str], list[str]]:
    """(importing unit, imported unit) -> the ``file:line`` places that make the edge."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        src = unit_of(module_parts(path))
        if src is None:
            continue
        for target, line in imported_modules(path):
            dst = unit_of(target)
            if dst is None or dst == src:
                continue
            where = f"{path.relative_to(PACKAGE_ROOT.parent)}:{line}"
            edges.setdefault((src, dst), []).append(where)
    return edges


def find_cycle(edges) -> list[str] | None:
    graph: dict[str, set[str]] = {}
    for src, dst in edges:
        graph.setdefault(src, set()).add(dst)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_every_unit_is_placed():
    units = {unit_of(module_parts(p)) for p in PACKAGE_ROOT.rglob("*.py")} - {None}
    assert units <= set(LAYERS) | set(LEAF), f"units without a layer: {units - set(LAYERS) - set(LEAF)}"


def test_parser_sees_function_level_and_relative_imports(tmp_path):
    pkg = tmp_path / "mini_paged_attn"
    for sub in ("cache", "ops"):
        (pkg / sub).mkdir(parents=True)
    (pkg / "ops" / "kv_quant.py").write_text("")
    mod = pkg / "cache" / "m.py"
    mod.write_text("def f():\n    from ..ops import kv_quant\n    import mini_paged_attn.core.args\n")
    targets = {t for t, _ in imported_modules(mod, pkg)}
    assert ("mini_paged_attn", "ops", "kv_quant") in targets
    assert ("mini_paged_attn", "core", "args") in targets


def test_subpackage_import_graph_has_no_cycle():
    cycle = find_cycle(unit_edges())
    assert cycle is None, "import cycle between subpackages: " + " -> ".join(cycle)


@pytest.mark.parametrize("src", sorted(set(LAYERS) | set(LEAF)))
def test_imports_point_down_the_documented_order(src):
    bad = []
    for (a, b), where in unit_edges().items():
        if a != src:
            continue
        if a in LEAF:
            ok = b in LEAF[a]
        elif b in LEAF:
            ok = a in LEAF_USERS
        else:
            ok = LAYERS[b] < LAYERS[a]
        if not ok:
            bad.append(f"{a} -> {b} at {', '.join(where[:3])}")
    assert not bad, "imports against docs/architecture.md's order:\n" + "\n".join(bad)
