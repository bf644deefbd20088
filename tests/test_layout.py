"""The package's layout shows its architecture, and these rules keep it that way.

Read from the source with ``ast`` (every import, those inside functions
too): no import cycle at any depth; the pure policy imports no Celery, kombu
or broker client; producer and worker code never import each other; the
broker packages never import each other nor anything above them; no library
module grows past 450 lines; the broker interfaces are typed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "celery_prio"
MAX_LINES = 450
BROKER_CLIENTS = ("celery", "kombu", "redis", "amqp")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


UNRESOLVED: list[tuple[str, str]] = []  # (module, import of ours that names no module of ours)


def _imports(module: str, path: Path) -> tuple[set[str], set[str]]:
    """``(modules of ours it imports, top-level third-party packages it imports)``."""
    ours, theirs = set(), set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".") if is_package else module.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            submodules = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
            targets = submodules if len(submodules) == len(node.names) else [base, *submodules]
            if base.split(".")[0] == "celery_prio" and base not in MODULES and not submodules:
                UNRESOLVED.append((module, base))
        else:
            continue
        for target in targets:
            if target.split(".")[0] != "celery_prio":
                theirs.add(target.split(".")[0])
                continue
            while target not in MODULES and "." in target:
                target = target.rsplit(".", 1)[0]
            if target != module:
                ours.add(target)
    return ours, theirs


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_every_import_of_ours_names_a_module():
    """A relative import one dot short still imports a package above it: caught here, not at run time."""
    assert UNRESOLVED == []


def test_no_import_cycle_at_any_depth():
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v][0]:
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

    for module in GRAPH:
        if module not in index:
            visit(module)
    assert cycles == []


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("celery_prio.brokers.redis", "celery_prio.brokers.amqp"),
        ("celery_prio.brokers.amqp", "celery_prio.brokers.redis"),
        ("celery_prio.producer", "celery_prio.worker"),
        ("celery_prio.worker", "celery_prio.producer"),
        ("celery_prio.brokers", "celery_prio.producer"),
        ("celery_prio.brokers", "celery_prio.worker"),
        ("celery_prio.brokers", "celery_prio.ops"),
        ("celery_prio.policy", "celery_prio.brokers"),
        ("celery_prio.policy", "celery_prio.producer"),
        ("celery_prio.policy", "celery_prio.worker"),
        ("celery_prio.settings", "celery_prio.policy"),
    ],
)
def test_layers_import_only_downwards(package, forbidden):
    wrong = sorted(
        (m, t) for m, (ours, _) in GRAPH.items() if _within(m, package) for t in ours if _within(t, forbidden)
    )
    assert wrong == []


def test_the_policy_is_pure():
    impure = sorted(
        (m, t)
        for m, (_, theirs) in GRAPH.items()
        if _within(m, "celery_prio.policy")
        for t in theirs
        if t in BROKER_CLIENTS
    )
    assert impure == []


def test_no_library_module_is_over_450_lines():
    library = {m: p for m, p in MODULES.items() if not m.startswith(("celery_prio.example", "celery_prio.tools"))}
    long = {m: n for m, p in library.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


@pytest.mark.parametrize("module", ["base.py", "publishing.py"])
def test_the_broker_interfaces_name_their_types(module):
    source = (PACKAGE / "brokers" / module).read_text()
    assert "Any" not in {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)}


def test_the_app_carries_no_attribute_of_ours():
    """The runtime is reached through ``runtime_of(app)`` (``runtime.py``): no ``_celery_prio_*`` attribute is set
    on or read from an app, a task or a Celery object anywhere in the library."""
    found = [m for m, p in MODULES.items() if "_celery_prio_" in p.read_text()]
    assert found == []


def test_the_task_consumer_only_wires():
    """``worker/task_consumer.py`` is kombu's Consumer stand-in over the worker's runtime: short, no decisions."""
    assert len((PACKAGE / "worker" / "task_consumer.py").read_text().splitlines()) <= 150


def test_no_module_imports_a_private_name_of_another():
    """What one module needs of another is public; Celery's private names live in ``celery_private.py`` only."""
    found = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("celery_prio")):
                found += [(module, a.name) for a in node.names if a.name.startswith("_")]
            elif isinstance(node, ast.ImportFrom) and module != "celery_prio.celery_private":
                found += [(module, a.name) for a in node.names if a.name.startswith("_") and a.name != "__version__"]
    assert found == []


def test_the_pure_policy_keeps_no_process_wide_state():
    """No module-level mutable object in ``policy/`` (a worker's state belongs to its runtime)."""
    found = []
    for module, path in MODULES.items():
        if not _within(module, "celery_prio.policy"):
            continue
        for node in ast.parse(path.read_text()).body:
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            names = [t.id for t in getattr(node, "targets", [getattr(node, "target", None)]) if isinstance(t, ast.Name)]
            if names == ["__all__"]:
                continue
            if isinstance(value, (ast.Call, ast.Dict, ast.List, ast.Set)):
                found.append((module, ast.unparse(node)[:60]))
    assert found == []
