"""The layering rules of docs/design.md, checked on the source: each layer's imports, read with ast."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PURE_CORE = ["wire", "cycle", "lifecycle", "plan", "guard", "ledger", "paths"]
HEAVY = {"torch", "deepspeed", "grpc", "kopf", "kubernetes", "prometheus_client", "matplotlib"}


def imports_of(path: Path, *, top_level_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def module_path(name: str) -> Path:
    return ROOT / "src" / "bubbles" / f"{name}.py"


@pytest.mark.parametrize("name", PURE_CORE)
def test_pure_core_imports_no_io_frameworks_and_no_outer_layer(name: str) -> None:
    path = module_path(name)
    if not path.exists():
        pytest.fail(f"{path} is missing")
    for imported in imports_of(path):
        root = imported.split(".")[0]
        assert root not in HEAVY | {"socket", "subprocess", "selectors"}, f"{name} imports {imported}"
        assert not imported.startswith(("bubbles.agent", "bubbles.operator", "bubbles.hook")), \
            f"{name} imports {imported}"


def test_hook_imports_nothing_from_agent_or_operator() -> None:
    for imported in imports_of(module_path("hook")):
        assert not imported.startswith(("bubbles.agent", "bubbles.operator")), imported


def test_agent_keeps_torch_out_of_module_level() -> None:
    for path in (ROOT / "agent" / "bubbles" / "agent").rglob("*.py"):
        roots = {i.split(".")[0] for i in imports_of(path, top_level_only=True)}
        assert not roots & {"torch", "deepspeed"}, f"{path} imports torch/deepspeed at module level"


def test_no_top_level_operator_package_shadows_the_standard_library() -> None:
    # A top-level `operator` package would shadow Python's standard library module of that name.
    assert not (ROOT / "operator" / "__init__.py").exists()
    assert not (ROOT / "agent" / "__init__.py").exists()
    import operator

    assert operator.__file__ is not None and "site-packages" not in operator.__file__
    assert Path(operator.__file__).parent != ROOT / "operator"
