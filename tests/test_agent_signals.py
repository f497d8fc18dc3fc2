"""The agent must be able to signal every fill process it admits (pause, resume, and the watchdog's SIGKILL).

In CSI mode a fill Pod's process runs as ``operator.fillRunAsUser`` (65532), not as the agent's UID: without
CAP_KILL the agent may not signal it. The real node showed it: the agent's stage thread died on the EPERM of a
pidfd signal and the next fill job on that GPU sat at 0 steps. Now admission checks the permission first
(``signal_problem``) and refuses with the reason, and a signal refused later is logged, never raised.
Run here as root, with processes that drop to other UIDs (as the chart's setpriv does), so the kernel decides."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="needs root and util-linux's setpriv, to run processes as other UIDs")

AGENT_UID = 1000
FILL_UID = 65532

PROBE = textwrap.dedent("""
    import json, logging, os, signal, socket, sys
    from bubbles.agent.cluster import AttachedProcess, signal_problem
    records = []
    class Keep(logging.Handler):
        def emit(self, r): records.append(r.getMessage())
    logging.getLogger("bubbles.agent.cluster").addHandler(Keep())
    other, own = int(sys.argv[1]), os.getpid()
    a, b = socket.socketpair()
    proc = AttachedProcess(other, a, speaks_control=False)
    proc.send_signal(signal.SIGSTOP)  # refused by the kernel: logged, not raised
    print(json.dumps({"other": signal_problem(other), "own": signal_problem(own),
                      "gone": signal_problem(2**22 + 7), "logged": records}))
""")


def _probe(as_uid: int, target: int) -> dict[str, object]:
    """PROBE as ``as_uid`` with CAP_DAC_OVERRIDE alone (the chart's agent without CSI; enough to read this checkout
    and interpreter under /root), so CAP_KILL is what it lacks."""
    keep = "-all,+dac_override"
    wrapper = ["setpriv", f"--reuid={as_uid}", f"--regid={as_uid}", "--clear-groups", f"--inh-caps={keep}",
               f"--ambient-caps={keep}", f"--bounding-set={keep}", "--no-new-privs"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([*wrapper, sys.executable, "-c", PROBE, str(target)], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_an_agent_without_cap_kill_refuses_another_users_fill_process_with_the_reason() -> None:
    fill = subprocess.Popen(["sleep", "60"], user=FILL_UID, group=FILL_UID)
    try:
        out = _probe(AGENT_UID, fill.pid)
        assert out["own"] is None
        assert "CAP_KILL" in str(out["other"]) and f"uid {FILL_UID}" in str(out["other"]), out
        assert "gone" in str(out["gone"]), out
        logged = out["logged"]
        assert isinstance(logged, list) and any("CAP_KILL" in m for m in logged), logged
        # The kernel refused it: the process was never stopped.
        with open(f"/proc/{fill.pid}/stat") as f:
            assert f.read().split(") ", 1)[1][0] in "SR", "the fill process was stopped by an agent without CAP_KILL"
    finally:
        fill.kill()
        fill.wait()


def test_the_same_uid_needs_no_capability() -> None:
    fill = subprocess.Popen(["sleep", "60"], user=AGENT_UID, group=AGENT_UID)
    try:
        out = _probe(AGENT_UID, fill.pid)
        assert out["other"] is None and out["logged"] == [], out
        with open(f"/proc/{fill.pid}/stat") as f:
            assert f.read().split(") ", 1)[1][0] == "T", "SIGSTOP was not delivered"
    finally:
        fill.kill()
        fill.wait()
