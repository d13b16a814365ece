"""The layout docs/ARCHITECTURE.md ("Layout: who may import whom") states, held on the code: imports run one way
(entry points -> stages -> library; inside serve/, promotion -> batch -> online), the local platform is never
imported by a stage, and no module imports one that imports it back (lazy imports inside functions count)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipelines", "core", "stack", "data", "train", "serve", "rayjobs", "posttrain")
STAGES = {"data", "train", "serve.online", "serve.batch", "serve.promotion", "rayjobs", "posttrain"}

# Which layer each layer may import (besides itself). Anything else is a violation.
ALLOWED = {
    "pipelines": {"core", "stack", *STAGES},
    "core": set(),
    "stack": {"core"},
    "data": {"core"},
    "train": {"core", "data"},
    "posttrain": {"core", "data", "train", "serve.online", "serve.batch"},
    "serve.online": {"core"},
    "serve.batch": {"core", "serve.online"},
    "serve.promotion": {"core", "serve.online", "serve.batch"},
    "rayjobs": {"core", "data", "train", "serve.online", "serve.batch", "serve.promotion", "posttrain"},
}


def layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "serve" and len(parts) > 1 and parts[1] in ("online", "batch", "promotion"):
        return f"serve.{parts[1]}"
    return parts[0]


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def import_edges() -> dict[str, set[str]]:
    """module -> the project modules it imports, at module level or inside functions."""
    known = {module_name(p) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for name in sorted(known):
        path = ROOT / (name.replace(".", "/") + ".py")
        if not path.exists():
            path = ROOT / name.replace(".", "/") / "__init__.py"
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    targets.add(full if full in known else node.module)
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
        edges[name] = {t for t in targets if t in known and t != name}
    return edges


def test_every_import_runs_the_way_the_layout_allows():
    wrong = sorted(f"{a} imports {b}" for a, targets in import_edges().items() for b in targets
                   if layer(a) != layer(b) and layer(b) not in ALLOWED[layer(a)])
    assert not wrong, "\n".join(wrong)


def test_no_module_imports_one_that_imports_it_back():
    edges = import_edges()
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for start in sorted(edges):
        if start not in state:
            visit(start, [start])
    assert not cycles, "\n".join(cycles)


def test_the_checks_see_a_violation_when_there_is_one():
    """The layer table is not vacuous: a stage importing the local platform, or the library importing a stage, is
    flagged by the same rule the first test applies."""
    assert "stack" not in ALLOWED[layer("train.worker")] and "train" not in ALLOWED[layer("core.registry")]
    assert "serve.promotion" not in ALLOWED[layer("serve.batch.pipeline")]
    edges = import_edges()
    assert "core.registry" in edges["train.trainer"] and edges["core.config"] <= {m for m in edges if m.startswith("core")}
