"""The chart rendered by Helm's own engine (helm-python-sdk), and the parts of it the tests look at."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers.crds import crds_for_1_20

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (the dev extra) renders the chart")

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "bubbles"
NS = "chart-system"
RELEASE = "chart"


def render(values: dict[str, Any] | None = None, namespace: str = NS, name: str = RELEASE) -> list[dict[str, Any]]:
    out = helm.Chart.load(str(CHART)).render(values or {}, name=name, namespace=namespace, is_install=True)
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def notes(values: dict[str, Any] | None = None) -> str:
    out = helm.Chart.load(str(CHART)).render(values or {}, name=RELEASE, namespace=NS, is_install=True)
    return next(v for k, v in out.items() if k.endswith("NOTES.txt"))


def one(docs: list[dict[str, Any]], kind: str, suffix: str = "") -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]
    return doc


def container(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    suffix = "-agent" if kind == "DaemonSet" else ""  # with MPS the daemon's DaemonSet too
    return one(docs, kind, suffix)["spec"]["template"]["spec"]["containers"][0]  # type: ignore[no-any-return]


def chart_for_1_20(dest: Path) -> Path:
    """A copy of the chart that installs on the tests' Kubernetes 1.20: its CRDs without their CEL rules and its
    kubeVersion widened to 1.20; everything else as shipped."""
    import shutil

    shutil.copytree(CHART, dest)
    crds_for_1_20(dest / "crds")
    chart_yaml = dest / "Chart.yaml"
    chart_yaml.write_text(re.sub(r"(?m)^kubeVersion: .*$", 'kubeVersion: ">=1.20.0-0"', chart_yaml.read_text()))
    return dest
