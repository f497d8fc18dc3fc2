"""One GPU node of a cluster, played on this machine for the operator's end-to-end tests.

Real: the node agent (``NodeAgent``) behind its gRPC service with mutual TLS, its metrics endpoint, and the fill
processes (each started with its Pod's own command and environment, as the kubelet would start the container).
Played: the training's hook, which writes its stage cards and signals a 10 ms bubble in every 100 ms iteration
on the wire protocol the real hook speaks (the real hook on real DeepSpeed is tested in test_hook and the demo).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bubbles.agent.cluster import ClusterConfig, NodeAgent
from bubbles.agent.config import AgentConfig
from bubbles.agent.isolation import IsolationConfig
from bubbles.agent.rpc import ServerSecurity, serve
from bubbles.core import paths, wire
from bubbles.core.api import IsolationMode
from bubbles.core.identity import GpuKey
from bubbles.operator.decide import fill_pod_node
from bubbles.operator.grpc_agents import ClientSecurity
from helpers.kubeapi import ApiServer
from helpers.pki import Pki

MIB = 2**20


def cycle(training: str, stage: int, stages: int) -> dict[str, Any]:
    """The bubble cycle a stage's hook profiles: one 10 ms bubble in a 100 ms iteration."""
    return {"training": training, "stage": stage, "stages": stages, "microbatches": 8, "schedule": "TrainSchedule",
            "iteration_s": 0.1, "samples": 5,
            "slots": [{"slot": 0, "position": 3, "instruction": "RecvGrad", "kind": "steady", "duration_s": 0.01,
                       "p10_s": 0.01, "p90_s": 0.01, "free_bytes": 1024 * MIB}]}


class LocalNode:
    """A node running one training's pipeline stages (``stages`` of them, one rank each with its hook card) and the
    agent."""

    def __init__(self, name: str, namespace: str, training: str, pod: str, tmp: Path, stages: int = 1,
                 metrics: bool = False) -> None:
        self.name, self.namespace, self.training, self.stages = name, namespace, training, stages
        pki = Pki.make(tmp / "pki")
        self.client_security = ClientSecurity(pki.ca.cert, pki.client.cert, pki.client.key)
        # Not under pytest's tmp_path: a fill socket's path there can be longer than a Unix socket allows.
        self.run_dir = Path(tempfile.mkdtemp(prefix="bbnode-", dir="/tmp"))
        self.node = NodeAgent(ClusterConfig(name, AgentConfig(run_dir=self.run_dir, training="placeholder",
                                                              isolation=IsolationConfig(mode=IsolationMode.NONE)),
                                            scan_interval_s=0.1))
        self.node.start()
        self.metrics_port = self.node.serve_metrics(0, "127.0.0.1") if metrics else None
        self.server = serve(self.node, "127.0.0.1:0", ServerSecurity(pki.server.cert, pki.server.key, pki.ca.cert))
        self.address = f"127.0.0.1:{self.server.port}"
        self.cards = [paths.hook_card(self.run_dir, GpuKey(namespace, training, stage, 0)) for stage in range(stages)]
        for stage, card in enumerate(self.cards):
            paths.make_private_dir(card.parent)
            paths.make_private_dir(card.parent / paths.FILLS_DIR_NAME)
            card.write_text(json.dumps({"training": training, "stage": stage, "stages": stages,
                                        "namespace": namespace, "pod": pod, "device": f"cpu:{stage}",
                                        "gpu_uuid": None, "fills": True, "version": 4, "rank": 0, "ranks": 1}))
        self.hook = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.stop = threading.Event()
        self.node.scan()
        for stage, card in enumerate(self.cards):
            self.hook.sendto(wire.encode_profile(stage, cycle(training, stage, stages)),
                             str(card.parent / "agent.sock"))
        self.bubbles = threading.Thread(target=self._signal_bubbles, daemon=True)
        self.bubbles.start()
        self.processes: list[subprocess.Popen[str]] = []

    def _send(self, stage: int, data: bytes) -> None:
        stage_dir = self.cards[stage].parent
        for p in [stage_dir / "agent.sock", *sorted((stage_dir / paths.FILLS_DIR_NAME).glob("*.sock"))]:
            with contextlib.suppress(OSError):
                self.hook.sendto(data, str(p))

    def _signal_bubbles(self) -> None:
        seq = 0
        while not self.stop.is_set():
            seq += 1
            start = time.monotonic_ns()
            for stage in range(self.stages):
                self._send(stage, wire.encode_bubble_start(stage, 0, seq, start, start + 10_000_000))
            self.stop.wait(0.010)
            for stage in range(self.stages):
                self._send(stage, wire.encode_bubble_end(stage, 0, seq, time.monotonic_ns()))
            self.stop.wait(0.090)

    def start_pod(self, kube: ApiServer, pod_name: str) -> subprocess.Popen[str]:
        """Start a fill Pod's container here, with the Pod's command and environment and the node's run dir
        where the Pod mounts the agent's hostPath."""
        proc = kube.kubectl("get", "pod", pod_name, "-n", self.namespace, "-o", "json")
        pod = json.loads(proc.stdout)
        # Pinned to this node by its affinity (this tier has no scheduler to bind it: nodeName stays unset).
        assert fill_pod_node(pod["spec"]) == self.name, f"{pod_name} is meant for {fill_pod_node(pod['spec'])}"
        (container,) = pod["spec"]["containers"]
        env = {e["name"]: e["value"] for e in container["env"]}
        env["BUBBLES_RUN_DIR"] = str(self.run_dir)  # the hostPath the Pod would mount, here
        command = [sys.executable if c == "python" else c for c in container["command"]]
        p = subprocess.Popen(command, env={**os.environ, **env}, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
        self.processes.append(p)
        return p

    def close(self) -> None:
        for p in self.processes:
            if p.poll() is None:
                p.kill()
            p.communicate()
        self.stop.set()
        self.bubbles.join(5)
        self.hook.close()
        self.server.stop()
        self.node.stop()
        shutil.rmtree(self.run_dir, ignore_errors=True)
