"""Set-ups of the cluster-mode agent's tests (tests/test_agent_cluster.py, tests/test_agent_rpc.py): the hook's card
a training writes, an assignment as the operator sends it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bubbles.core import paths
from bubbles.core.agentapi import AssignmentMessage
from bubbles.core.api import parse_spec
from helpers.agent import TRAINING

NODE = "node-a"
ENTRY = "bubbles.fill_examples.spin:SpinJob"


def write_card(run_dir: Path, stage: int = 0, pod: str = "llama-0", stages: int = 1, **extra: Any) -> Path:
    path = paths.hook_card(run_dir, TRAINING, stage)
    paths.make_private_dir(path.parent)
    card = {"training": TRAINING, "stage": stage, "stages": stages, "namespace": "ml", "pod": pod, "device": "cpu",
            "gpu_uuid": None, "pid": 1, "fills": True, **extra}
    path.write_text(json.dumps(card))
    return path


def assignment(uid: str = "uid-1", attempt: int = 0, generation: int = 1, gpu_uuid: str | None = None,
               name: str = "fj") -> AssignmentMessage:
    spec = parse_spec({"name": name, "entry": ENTRY, "memory": "16Mi", "step_time": "1ms",
                       "args": {"step_us": 200}})
    return AssignmentMessage(uid, generation, attempt, "ml", name, TRAINING, 0, "llama-0", "cpu",
                             f"fj-{name}-a{attempt}", spec, gpu_uuid)
