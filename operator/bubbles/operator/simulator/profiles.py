"""Fill-job model profiles (per-step time, memory, FLOPs per sample for a few batch sizes), read from JSON.

The shipped file is ``bubbles/data/model_profiles.json``; its ``source`` field says where the
numbers come from. A profile file names models and kinds; each configuration's step is a chain of
``nodes`` equal nodes (one per layer) for the execution plan.
"""

from __future__ import annotations

import json
import math
from importlib import resources
from pathlib import Path
from typing import Any

from bubbles.core.api import WorkloadKind
from bubbles.core.plan import FillNode
from bubbles.operator.scheduler.core import FillConfig, FillProfile


def default_profiles_path() -> Path:
    return Path(str(resources.files("bubbles.operator.simulator.data").joinpath("model_profiles.json")))


def load_profiles(path: str | Path | None = None) -> dict[tuple[str, WorkloadKind], FillProfile]:
    """Profiles keyed by (model, kind), a kind written as its WorkloadKind label in the file.
    Raises ValueError naming the file and the first bad field."""
    p = Path(path) if path is not None else default_profiles_path()
    try:
        doc = json.loads(p.read_text())
    except OSError as e:
        raise ValueError(
            f"cannot read model profiles {p}: {e.strerror}; pass an existing JSON file"
        ) from None
    except json.JSONDecodeError as e:
        raise ValueError(f"model profiles {p} is not valid JSON ({e}); fix the file") from None
    try:
        return parse_profiles(doc)
    except ValueError as e:
        raise ValueError(f"model profiles {p}: {e}") from None


def parse_profiles(doc: Any) -> dict[tuple[str, WorkloadKind], FillProfile]:
    if not isinstance(doc, dict) or not isinstance(doc.get("models"), list) or not doc["models"]:
        raise ValueError('expected an object with a non-empty "models" list')
    out: dict[tuple[str, WorkloadKind], FillProfile] = {}
    for i, m in enumerate(doc["models"]):
        where = f"models[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{where} must be an object")
        model = _str(m, "model", where)
        kind = WorkloadKind.parse(_str(m, "kind", where), f"{where}.kind")
        configs = []
        raw = m.get("configs")
        if not isinstance(raw, list) or not raw:
            raise ValueError(f"{where}.configs must be a non-empty list")
        for j, c in enumerate(raw):
            cw = f"{where}.configs[{j}]"
            if not isinstance(c, dict):
                raise ValueError(f"{cw} must be an object")
            nodes = _int(c, "nodes", cw)
            step_s = _pos(c, "step_s", cw)
            mem = _int(c, "memory_bytes", cw, minimum=0)
            node = FillNode(step_s / nodes, mem)
            configs.append(
                FillConfig(
                    name=_str(c, "name", cw),
                    batch_size=_int(c, "batch_size", cw),
                    nodes=(node,) * nodes,
                    offload=bool(c.get("offload", False)),
                )
            )
        out[(model, kind)] = FillProfile(
            model=model,
            kind=kind,
            flops_per_sample=_pos(m, "flops_per_sample", where),
            isolated_samples_per_s=_pos(m, "isolated_samples_per_s", where),
            configs=tuple(configs),
        )
    return out


def _str(d: dict[str, Any], k: str, where: str) -> str:
    v = d.get(k)
    if not isinstance(v, str) or not v:
        raise ValueError(f"{where}.{k} must be a non-empty string, got {v!r}")
    return v


def _int(d: dict[str, Any], k: str, where: str, minimum: int = 1) -> int:
    v = d.get(k)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{where}.{k} must be an integer >= {minimum}, got {v!r}")
    return v


def _pos(d: dict[str, Any], k: str, where: str) -> float:
    v = d.get(k)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{where}.{k} must be a number > 0, got {v!r}")
    return float(v)
