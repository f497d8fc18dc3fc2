"""Shared test set-up: the benchmarks folder (not installed) is importable, as ``python benchmarks/X.py`` sees it."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))


import pytest  # noqa: E402
from helpers.crds import crds_for_1_20  # noqa: E402
from helpers.kubeapi import ApiServer, api_server, find_assets  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    """One real kube-apiserver (and etcd) for the session, with the CRDs applied; skipped loudly without it."""
    assets, why = find_assets()
    if assets is None:
        pytest.skip(f"REAL API SERVER TIER SKIPPED: {why}")
    with api_server(tmp_path_factory.mktemp("kube"), assets) as server:
        # 1.20 predates the CRDs' CEL rules: applied without them (tests/test_crd_rules.py evaluates the rules).
        server.kubectl("apply", "-f", str(crds_for_1_20(tmp_path_factory.mktemp("crds"))))
        server.kubectl("wait", "--for", "condition=established", "--timeout", "30s",
                       "crd/filljobs.bubbles.dev", "crd/pipelinetrainings.bubbles.dev")
        yield server
