"""The layers of docs/design.md, as the import-linter contracts in pyproject.toml state them: the real contracts
are kept, and each one can fail (one violating import injected into the real graph breaks that contract alone)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grimp
import pytest
from importlinter import configuration
from importlinter.application import use_cases
from importlinter.application.app_config import settings
from importlinter.application.ports.reporting import Report
from importlinter.application.user_options import UserOptions

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"
CONTRACTS = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]
CONTRACT_IDS = [c["id"] for c in CONTRACTS]

# One import per contract that breaks it and no other. Sources are real modules; an external target (torch,
# kopf, ...) is added the way grimp adds an external package: one squashed node named after its top level.
# A core module importing the agent would break "training" too (the hook imports the core), so the core's
# case is a framework only the core forbids.
VIOLATIONS: dict[str, tuple[str, str]] = {
    "layers": ("bubbles.agent.server", "bubbles.operator.rbac"),
    "operator-layers": ("bubbles.operator.decide", "bubbles.operator.metrics"),
    "core": ("bubbles.core.wire", "numpy"),
    "training": ("bubbles.training.hook", "kopf"),
    "scheduler": ("bubbles.operator.scheduler.core", "kubernetes"),
    "operator": ("bubbles.operator.cli", "torch"),
    "agent": ("bubbles.agent.server", "kopf"),
    "benchmarks": ("bubbles.demo.orchestrate.phases", "gpubench.report"),
    "gpubench": ("gpubench.report", "bubbles.demo.report"),
}


def test_no_top_level_operator_package_shadows_the_standard_library() -> None:
    # A top-level `operator` package would shadow Python's standard library module of that name.
    assert not (ROOT / "operator" / "__init__.py").exists()
    assert not (ROOT / "agent" / "__init__.py").exists()
    import operator

    assert operator.__file__ is not None and "site-packages" not in operator.__file__
    assert Path(operator.__file__).parent != ROOT / "operator"


def test_lint_imports_keeps_every_contract() -> None:
    """What `make lint` runs: the real contracts against the real source, from the repository root."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, ["benchmarks", os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([str(Path(sys.executable).parent / "lint-imports"), "--no-cache", "--no-logo"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"Contracts: {len(CONTRACTS)} kept, 0 broken." in proc.stdout, proc.stdout


# --- Each contract can fail --------------------------------------------------------------------------------


class GivenGraph:
    """import-linter's graph-builder port, answering with a graph built beforehand."""

    def __init__(self, graph: grimp.ImportGraph) -> None:
        self.graph = graph

    def build(self, **_: Any) -> grimp.ImportGraph:
        return self.graph


@pytest.fixture(scope="module")
def linter() -> Iterator[tuple[UserOptions, grimp.ImportGraph]]:
    """pyproject.toml's import-linter options, read by import-linter, and the real import graph, built once."""
    configuration.configure()
    options = use_cases.read_user_options(config_filename=str(PYPROJECT))
    use_cases._register_contract_types(options)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(ROOT / "benchmarks"))  # gpubench is a root package and is not installed
        graph = grimp.build_graph(*options.session_options["root_packages"], include_external_packages=True,
                                  cache_dir=None)
        yield options, graph


def report_on(options: UserOptions, graph: grimp.ImportGraph) -> Report:
    """import-linter's own report (every contract of pyproject.toml, its contract classes) on ``graph``."""
    saved = settings.GRAPH_BUILDER
    settings.configure(GRAPH_BUILDER=GivenGraph(graph))
    try:
        report = use_cases.create_report(options, cache_dir=None)
    finally:
        settings.configure(GRAPH_BUILDER=saved)
    assert not report.could_not_run, report.invalid_contract_options
    return report


def kept_by_id(report: Report) -> dict[str, bool]:
    return {contract.contract_options["id"]: check.kept for contract, check in report.get_contracts_and_checks()}


def broken_chains(metadata: dict[str, Any]) -> Iterator[list[dict[str, Any]]]:
    """Each chain of imports a broken contract reports: a forbidden contract's and a layers contract's metadata
    differ in shape."""
    for chains in metadata.get("invalid_chains", []):
        yield from chains["chains"]
    for dependency in metadata.get("invalid_dependencies", []):
        for route in dependency["routes"]:
            yield [*route["chain"], *route["extra_firsts"], *route["extra_lasts"]]


def test_every_contract_has_a_violation_below() -> None:
    assert sorted(VIOLATIONS) == sorted(CONTRACT_IDS)


def test_the_real_graph_keeps_every_contract(linter: tuple[UserOptions, grimp.ImportGraph]) -> None:
    # The baseline for the cases below, through the same machinery.
    options, graph = linter
    assert kept_by_id(report_on(options, graph)) == dict.fromkeys(CONTRACT_IDS, True)


@pytest.mark.parametrize("contract_id", CONTRACT_IDS)
def test_each_contract_can_fail(contract_id: str, linter: tuple[UserOptions, grimp.ImportGraph]) -> None:
    options, real = linter
    importer, imported = VIOLATIONS[contract_id]
    graph = copy.deepcopy(real)
    assert importer in graph.modules, f"{importer} is not in the import graph"
    if imported in graph.modules:
        assert not graph.direct_import_exists(importer=importer, imported=imported), "already imported"
    else:
        assert imported.split(".")[0] not in {"bubbles", "gpubench"}, f"{imported} is not in the import graph"
        graph.add_module(imported, is_squashed=True)
    graph.add_import(importer=importer, imported=imported, line_number=1, line_contents=f"import {imported}")

    report = report_on(options, graph)
    assert kept_by_id(report) == {cid: cid != contract_id for cid in CONTRACT_IDS}
    (check,) = [c for contract, c in report.get_contracts_and_checks()
                if contract.contract_options["id"] == contract_id]
    links = {(link["importer"], link["imported"]) for chain in broken_chains(check.metadata) for link in chain}
    assert (importer, imported) in links  # broken by the injected import, not by something else
    # The shared graph is untouched.
    assert imported not in real.modules or not real.direct_import_exists(importer=importer, imported=imported)


@pytest.mark.parametrize(("new_module", "contract_id"), [("bubbles.newpart", "layers"),
                                                        ("bubbles.operator.newpart", "operator-layers")])
def test_a_module_under_no_layer_breaks_its_layers_contract(
        new_module: str, contract_id: str, linter: tuple[UserOptions, grimp.ImportGraph]) -> None:
    """A new ``core/bubbles/x.py`` (or a module dropped into the operator's package) falls under no layer: the
    contract is exhaustive, so import-linter refuses it until the module is given a layer."""
    options, real = linter
    graph = copy.deepcopy(real)
    graph.add_module(new_module)
    report = report_on(options, graph)
    assert kept_by_id(report) == {cid: cid != contract_id for cid in CONTRACT_IDS}


def test_every_module_of_bubbles_is_under_a_layer(linter: tuple[UserOptions, grimp.ImportGraph]) -> None:
    """Each top-level part of ``bubbles`` (the folders' subpackages and the public faces) is named by the layers
    contract, so every module, however deep, has a layer."""
    _, graph = linter
    (layers,) = [c for c in CONTRACTS if c["id"] == "layers"]
    named = {name.strip() for layer in layers["layers"] for name in layer.replace(":", "|").split("|")}
    parts = {m.split(".")[1] for m in graph.modules if m.startswith("bubbles.")}
    assert parts == named
