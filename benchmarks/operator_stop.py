"""How long `bubbles operator` takes to stop on SIGTERM, and whether its Lease is released: the real command against
a real kube-apiserver (1.20, RBAC on; the tests' helpers start it, tools/kube-from-debian.sh builds it).

    python benchmarks/operator_stop.py --runs 7

Prints each run's time from the signal to the process's exit, the median with its range, and the Lease's holder
after each exit (empty: released).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from helpers.kubeapi import OPERATOR_NAMESPACE, api_server, find_assets  # noqa: E402

from bubbles.operator.rbac import cluster_role, cluster_role_binding  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    assets, why = find_assets()
    if assets is None:
        print(f"no API server: {why}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as d, api_server(Path(d) / "kube", assets) as kube:
        kube.kubectl("apply", "-f", "-", input_text=json.dumps({"apiVersion": "v1", "kind": "List", "items": [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": OPERATOR_NAMESPACE}},
            cluster_role(), cluster_role_binding(OPERATOR_NAMESPACE, "bubbles-operator")]}))
        from helpers.crds import crds_for_1_20

        kube.kubectl("apply", "-f", str(crds_for_1_20(Path(d) / "crds")))
        took, holders = [], []
        for i in range(args.runs):
            lease = f"stop-{i}"
            proc = subprocess.Popen([sys.executable, "-m", "bubbles.cli", "operator", "--kubeconfig",
                                     str(kube.operator_kubeconfig), "--lease-name", lease, "--lease-namespace",
                                     OPERATOR_NAMESPACE, "--identity", "bench", "--metrics-port", "0"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

            def holder(lease: str = lease) -> str | None:
                got = kube.kubectl("get", "lease", lease, "-n", OPERATOR_NAMESPACE, "-o", "json", check=False)
                return json.loads(got.stdout)["spec"].get("holderIdentity") if got.returncode == 0 else None

            deadline = time.monotonic() + 60
            while holder() != "bench":
                if time.monotonic() > deadline:
                    proc.kill()
                    print("the operator never took its Lease", file=sys.stderr)
                    return 1
                time.sleep(0.1)
            t0 = time.monotonic()
            proc.terminate()
            proc.wait(timeout=60)
            took.append(time.monotonic() - t0)
            holders.append(holder() or "")
            print(f"run {i + 1}: {took[-1]:.2f} s, exit code {proc.returncode}, Lease holder {holders[-1]!r}")
        print(f"SIGTERM to exit: median {statistics.median(took):.2f} s, range {min(took):.2f}-{max(took):.2f} s "
              f"over {len(took)} runs; Lease released in {sum(h == '' for h in holders)} of {len(holders)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
