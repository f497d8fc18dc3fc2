"""The node agent's API: the committed stubs are what tools/gen-proto.sh makes of the .proto, the messages carry every
field of the core types they stand for, values survive the round trip, and bad messages are refused by name."""

from __future__ import annotations

import dataclasses
import filecmp
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bubbles.core import agentapi
from bubbles.core.agentapi.v1alpha1 import agent_pb2 as pb
from bubbles.core.api import FillInterface, FillJobSpec, FillNode, FillState, WorkloadKind
from bubbles.core.resources import JobProgress, NodeReport, StageReport

ROOT = Path(__file__).resolve().parent.parent
STUBS = ROOT / "core" / "bubbles" / "core" / "agentapi" / "v1alpha1"


def test_the_committed_stubs_are_generated_from_the_proto(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    subprocess.run([str(ROOT / "tools" / "gen-proto.sh"), str(tmp_path)], check=True, env=env, cwd=ROOT, timeout=120)
    fresh = tmp_path / "bubbles" / "core" / "agentapi" / "v1alpha1"
    names = sorted(p.name for p in fresh.iterdir())
    assert names == ["agent_pb2.py", "agent_pb2.pyi", "agent_pb2_grpc.py"]
    stale = [n for n in names if not filecmp.cmp(fresh / n, STUBS / n, shallow=False)]
    assert not stale, f"{stale} differ from the .proto: run tools/gen-proto.sh and commit the result"


def _fields(message: type) -> set[str]:
    return {f.name.removesuffix("_json") for f in message.DESCRIPTOR.fields}  # type: ignore[attr-defined]


@pytest.mark.parametrize(("core", "message", "extra"), [
    (StageReport, pb.StageReport, set()),
    (JobProgress, pb.JobProgress, set()),
    (NodeReport, pb.NodeReport, set()),
    (FillJobSpec, pb.FillJobSpec, set()),
    (FillNode, pb.FillNode, set()),
])
def test_each_message_carries_exactly_the_fields_of_its_core_type(core: type, message: type, extra: set[str]) -> None:
    assert {f.name for f in dataclasses.fields(core)} == _fields(message) - extra


def test_reports_and_specs_survive_the_round_trip() -> None:
    cycle = {"training": "t", "stage": 1, "slots": []}
    report = NodeReport("node-a", (
        StageReport("ml", "t", "p-1", 1, "cuda:0", cycle, True, 0.2, 0.19, 12.5, 6.25, "GPU-1", "client"),
        StageReport("ml", "t", "p-2", 2, "cpu"),
        StageReport("ml", "t", "p-3", 3, "cuda:1", None, True, training_membership="not a client: pid 7 is not listed"),
    ), (JobProgress("u1", FillState.RUNNING, 10, 1e9, "", 1, 3), JobProgress("u2", FillState.STOPPED, reason="x")))
    back = agentapi.report_from_pb(pb.NodeReport.FromString(agentapi.report_to_pb(report).SerializeToString()))
    assert back == report
    specs = [
        FillJobSpec("a", FillInterface.ITERATIVE, "m:C", None, {"k": [1, 2]}, 100, 1 << 20, 0.002, (), 2,
                    WorkloadKind.BATCH_INFERENCE, 1800.0),
        FillJobSpec("b", FillInterface.IMPERATIVE, None, ("run", "--fast"), {}, None, 0, None,
                    (FillNode(0.001, 5), FillNode(0.002, 6)), None, None),
        FillJobSpec("c", FillInterface.ITERATIVE, "m:C", None, {}, 5, 0, None, (), None, None, None, 2.5e9),
        FillJobSpec("d", FillInterface.ITERATIVE, "m:C", None, {}, 5, 0, None, (), None, None, None, 0.0),
    ]
    for spec in specs:
        assert agentapi.spec_from_pb(agentapi.spec_to_pb(spec)) == spec


@pytest.mark.parametrize(("message", "error"), [
    (pb.FillJobSpec(name="x", interface="iterative"), "neither entry nor command"),
    (pb.FillJobSpec(name="x", interface="iterative", entry="m:C", args_json="[1]"), "JSON object"),
    (pb.FillJobSpec(name="x", interface="iterative", entry="m:C", args_json="{"), "not JSON"),
    (pb.FillJobSpec(name="x", interface="iterative", entry="m:C", memory_bytes=-1), "memory_bytes"),
    (pb.FillJobSpec(name="x", interface="iterative", entry="m:C", steps=0), "steps"),
    (pb.FillJobSpec(name="x", interface="iterative", entry="m:C", step_time_s=0.0), "step_time_s"),
    (pb.FillJobSpec(name="x", interface="iterative", entry="m:C", kind="painting"), "kind"),
    (pb.FillJobSpec(name="x", interface="iterative", entry="m:C", init_timeout_s=0.0), "init_timeout_s must be more"),
    (pb.FillJobSpec(name="x", interface="iterative", entry="m:C", init_timeout_s=1e9), "at most a day"),
    (pb.FillJobSpec(name="x", interface="iterative", entry="m:C", flops_per_step=-1.0), "flops_per_step must be"),
    (pb.FillJobSpec(name="x", interface="iterative", entry="m:C", flops_per_step=float("nan")), "flops_per_step"),
    (pb.FillJobSpec(name="x", interface="iterative", entry="m:C", flops_per_step=float("inf")), "flops_per_step"),
])
def test_a_bad_spec_is_refused_with_the_field(message: pb.FillJobSpec, error: str) -> None:
    with pytest.raises(agentapi.ApiError, match=error):
        agentapi.spec_from_pb(message)


def test_a_bad_report_is_refused_with_the_field() -> None:
    with pytest.raises(agentapi.ApiError, match="state"):
        agentapi.report_from_pb(pb.NodeReport(node="n", jobs=[pb.JobProgress(uid="u", state="DANCING")]))
    with pytest.raises(agentapi.ApiError, match="no uid"):
        agentapi.report_from_pb(pb.NodeReport(node="n", jobs=[pb.JobProgress(state="RUNNING")]))
    with pytest.raises(agentapi.ApiError, match="cycle_json"):
        agentapi.report_from_pb(pb.NodeReport(node="n", stages=[pb.StageReport(training="t", cycle_json="{x")]))
    with pytest.raises(agentapi.ApiError, match="stages count from 0"):
        agentapi.report_from_pb(pb.NodeReport(node="n", stages=[pb.StageReport(training="t", stage=-1)]))


def test_a_stages_gpu_resource_crosses_the_wire_and_a_bad_one_is_refused() -> None:
    """The device plugin's resource for a GPU, which the operator writes into fill Pods' limits: kept as sent, absent
    from an older agent, refused when it is not an extended resource's name."""
    def resource(name: str) -> str:
        report = pb.NodeReport(node="n", stages=[pb.StageReport(training="t", gpu_resource=name)])
        return agentapi.report_from_pb(report).stages[0].gpu_resource

    assert resource("bubbles.dev/gpu-3") == "bubbles.dev/gpu-3" and resource("") == ""
    wire = agentapi.stage_to_pb(StageReport("ns", "t", "p", 0, "cuda:0", gpu_resource="bubbles.dev/gpu-1"))
    assert agentapi.report_from_pb(pb.NodeReport(node="n", stages=[wire])).stages[0].gpu_resource == "bubbles.dev/gpu-1"
    for bad in ("gpu-0", "bubbles.dev/", "Bubbles.dev/gpu-0", "bubbles.dev/gpu 0", "bubbles.dev/" + "x" * 64,
                "a/b/c"):
        with pytest.raises(agentapi.ApiError, match="gpu_resource"):
            resource(bad)


def test_a_stages_training_membership_is_one_of_its_words_and_bounded() -> None:
    """What the operator writes into a PipelineTraining's condition comes from the agent: only the two answers it
    knows are kept (a newer agent's other word reads as unknown), a message cut to a bound."""
    def membership(text: str) -> str:
        report = pb.NodeReport(node="n", stages=[pb.StageReport(training="t", training_membership=text)])
        return agentapi.report_from_pb(report).stages[0].training_membership

    assert membership("client") == "client" and membership("") == ""
    assert membership("maybe, in a new way") == ""
    long = "not a client: " + "x" * 5000
    assert membership(long) == long[:agentapi.MAX_MEMBERSHIP_CHARS]


def _assign_request(**limits: float) -> pb.AssignRequest:
    spec = pb.FillJobSpec(name="x", interface="iterative", entry="m:C")
    return pb.AssignRequest(uid="u", training="t", fill_pod="p", spec=spec, **limits)


def test_an_assignment_carries_the_trainings_guard_limits_or_none() -> None:
    spec = FillJobSpec("a", FillInterface.ITERATIVE, "m:C", None, {}, 10, 0, None, (), None, None)
    with_limits = agentapi.AssignmentMessage("u", 2, 1, "ml", "fj", "t", 0, "p", "cpu", "fp", spec, None, 0.02, 0.5,
                                             0.0)
    without = dataclasses.replace(with_limits, slowdown_budget=None, max_fill_share=None, tail_risk=None)
    for msg in (with_limits, without):
        wire = agentapi.assignment_to_pb(msg).SerializeToString()
        assert agentapi.assignment_from_pb(pb.AssignRequest.FromString(wire)) == msg


@pytest.mark.parametrize(("limits", "error"), [
    ({"slowdown_budget": 0.0}, "slowdown_budget is 0.0; it must be in \\(0, 1\\)"),
    ({"slowdown_budget": 1.5}, "spec.slowdownBudget"),
    ({"slowdown_budget": float("nan")}, "slowdown_budget is nan"),
    ({"max_fill_share": -0.5}, "max_fill_share is -0.5; it must be in \\[0, 1\\]"),
    ({"max_fill_share": 1.01}, "spec.maxFillShare"),
    ({"tail_risk": 0.51}, "tail_risk \\(the PipelineTraining's spec.tailRisk\\) must be the accepted chance"),
    ({"tail_risk": -0.01}, "from 0 \\(never start one\\) to 0.5"),
    ({"tail_risk": float("nan")}, "got nan"),
])
def test_guard_limits_out_of_range_are_refused_with_the_field(limits: dict[str, float], error: str) -> None:
    with pytest.raises(agentapi.ApiError, match=error):
        agentapi.assignment_from_pb(_assign_request(**limits))
