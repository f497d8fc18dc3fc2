"""Every rank of a stage filled, beside a real agent: a DeepSpeed pipeline of 2 stages x 2 data-parallel replicas (4
processes, ``tests/fixtures/trainings/ranks_pipeline.py``) and a local agent with a spin fill job per GPU, each
naming only its stage. The agent serves rank 0 of each stage from the start and finds rank 1 from its hook's card;
it puts each stage's two jobs on its two ranks. Every GPU gets fill steps, and the losses stay bit-identical.
(Model-parallel ranks are filled by ``bubbles demo --tp 2``: tests/test_demo.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bubbles.demo.orchestrate.processes import free_port, stop_gracefully, tail, wait_for_file, wait_for_fill_jobs

pytestmark = pytest.mark.deepspeed

TRAININGS = Path(__file__).resolve().parent / "fixtures" / "trainings"
STAGES, RANKS = 2, 2
WARMUP, PROFILE, STEPS = 1, 2, 60  # 57 iterations after the fill jobs are ready
FREE_BYTES = 1 << 30
TIMEOUT_S = 180


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("ranks-filled")
    run_dir = Path(tempfile.mkdtemp(prefix="bbrf-", dir="/tmp"))  # short: Unix socket paths are 107 bytes at most
    out, stats, ready, start = work / "out", work / "agent-stats.json", work / "agent.ready", work / "start"
    specs = []
    for k in range(STAGES):
        for r in range(RANKS):
            spec = {"name": f"spin-s{k}-{r}", "interface": "iterative", "entry": "bubbles.fill_examples.spin:SpinJob",
                    "args": {"step_us": 300}, "memory": "1Mi", "step_time": "0.5ms", "stage": k}
            path = work / f"{spec['name']}.json"
            path.write_text(json.dumps(spec))
            specs.append(path)
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "bubbles.cli", "agent", "--run-dir", str(run_dir), "--training", "dp",
           "--executors", str(STAGES), "--stats", str(stats), "--ready-file", str(ready), "--metrics-port", str(port)]
    for path in specs:
        cmd += ["--fill-job", str(path)]
    agent_log = work / "agent.log"
    with agent_log.open("w") as log:
        agent = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    training: subprocess.Popen[str] | None = None
    try:
        assert wait_for_file(ready, agent, 60), "the agent did not start:\n" + tail(agent_log)
        training = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(STAGES * RANKS),
             "--master_port", str(free_port()), str(TRAININGS / "ranks_pipeline.py"), "--out", str(out),
             "--stages", str(STAGES), "--mp", "1", "--dp", str(RANKS), "--steps", str(STEPS),
             "--warmup-iterations", str(WARMUP), "--profile-iterations", str(PROFILE), "--run-dir", str(run_dir),
             "--training", "dp", "--free-bytes", str(FREE_BYTES), "--start-file", str(start)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        outcome = wait_for_fill_jobs(port, len(specs), agent, 120)
        start.touch()
        text, _ = training.communicate(timeout=TIMEOUT_S)
    finally:
        if training is not None and training.poll() is None:
            training.kill()
            training.wait(timeout=10)
        stop_gracefully(agent, timeout_s=30)
        subprocess.run(["rm", "-rf", str(run_dir)], check=False, timeout=60)
    assert training.returncode == 0, text[-6000:]
    records = [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]
    yield {"records": records, "stats": json.loads(stats.read_text()), "ready": outcome,
           "agent_log": tail(agent_log, 40)}


def test_every_data_parallel_rank_gets_fill_steps_from_a_job_of_its_own(run: dict[str, Any]) -> None:
    stats = run["stats"]
    steps: dict[tuple[int, int], int] = {(k, r): 0 for k in range(STAGES) for r in range(RANKS)}
    for st in stats["steps"]:
        steps[(st["stage"], st["rank"])] += 1
    jobs = {j["name"]: (j["stage"], j["rank"], j["state"], j.get("reason")) for j in stats["jobs"]}
    message = f"fill steps by (stage, rank) {steps}; jobs {jobs}; ready: {run['ready']}\n{run['agent_log']}"
    assert all(n > 0 for n in steps.values()), message
    placed = sorted((stage, rank) for stage, rank, _state, _reason in jobs.values())
    assert placed == sorted(steps), message  # one job per GPU: each stage's two went to its two ranks


def test_the_losses_are_bit_identical_on_every_rank_beside_the_fill_jobs(run: dict[str, Any]) -> None:
    assert len(run["records"]) == STAGES * RANKS
    for rec in run["records"]:
        assert rec["losses_with"] == rec["losses_without"], f"rank {rec['rank']}: the losses changed"
        assert rec["stats"]["bubbles_signalled"] > 0
