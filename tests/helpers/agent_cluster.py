"""Set-ups of the cluster-mode agent's tests (tests/test_agent_cluster.py, tests/test_agent_rpc.py): the hook's card
a training writes, an assignment as the operator sends it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bubbles.core import paths
from bubbles.core.agentapi import AssignmentMessage
from bubbles.core.api import parse_spec
from bubbles.core.identity import GpuKey
from helpers.agent import TRAINING

NODE = "node-a"
NAMESPACE = "ml"  # the training Pods' namespace in these tests
TR = (NAMESPACE, TRAINING)  # the training, namespace-qualified: NodeAgent.trainings' key
ENTRY = "bubbles.fill_examples.spin:SpinJob"


def write_card(run_dir: Path, stage: int = 0, pod: str = "llama-0", stages: int = 1, rank: int = 0, ranks: int = 1,
               namespace: str = "ml", training: str = TRAINING, version: int = 4, **extra: Any) -> Path:
    """A card as the hook writes it: v4 in its GPU's directory, or (``version`` 3) as a hook before ranks wrote it, in
    its stage's directory of the old layout, one rank per stage."""
    if version >= 4:
        path = paths.hook_card(run_dir, GpuKey(namespace, training, stage, rank))
        more: dict[str, Any] = {"rank": rank, "ranks": ranks, "version": version}
    else:
        path = paths.legacy_stage_dir(run_dir, training, stage) / paths.HOOK_CARD_NAME
        more = {"version": version}
    paths.make_private_dir(path.parent)
    card = {"training": training, "stage": stage, "stages": stages, "namespace": namespace, "pod": pod,
            "device": "cpu", "gpu_uuid": None, "pid": 1, "fills": True, **more, **extra}
    path.write_text(json.dumps(card))
    return path


def legacy_card_path(run_dir: Path, training: str, stage: int) -> Path:
    """Where a hook before card v4 wrote its card (one rank per stage, no namespace)."""
    path = paths.legacy_stage_dir(run_dir, training, stage) / paths.HOOK_CARD_NAME
    paths.make_private_dir(path.parent)
    return path


def assignment(uid: str = "uid-1", attempt: int = 0, generation: int = 1, gpu_uuid: str | None = None,
               name: str = "fj", ranks: tuple[int, ...] = (0,), namespace: str = "ml",
               stage: int = 0) -> AssignmentMessage:
    spec = parse_spec({"name": name, "entry": ENTRY, "memory": "16Mi", "step_time": "1ms",
                       "args": {"step_us": 200}})
    return AssignmentMessage(uid, generation, attempt, namespace, name, TRAINING, stage, "llama-0", "cpu",
                             f"fj-{name}-a{attempt}", spec, gpu_uuid, ranks=ranks)
