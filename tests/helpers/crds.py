"""The CRDs as the tests' only real API server (Kubernetes 1.20) takes them: without their CEL rules."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]


def without_cel(obj: Any) -> Any:
    """A CRD (or any data) with its CEL rules (``x-kubernetes-validations``) taken out: what a Kubernetes 1.20 API
    server takes (it predates them, and its server-side apply refuses the field). tests/test_crd_rules.py evaluates
    the rules themselves."""
    if isinstance(obj, dict):
        return {k: without_cel(v) for k, v in obj.items() if k != "x-kubernetes-validations"}
    if isinstance(obj, list):
        return [without_cel(v) for v in obj]
    return obj


def crds_for_1_20(dest: Path) -> Path:
    """crds/ written to ``dest`` without their CEL rules; ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    for path in sorted((ROOT / "crds").glob("*.yaml")):
        (dest / path.name).write_text(yaml.safe_dump(without_cel(yaml.safe_load(path.read_text())), sort_keys=False))
    return dest
