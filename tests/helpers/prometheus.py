"""A real Prometheus (Debian's package, tools/prometheus-from-debian.sh) on loopback, scraping every second."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.request
from pathlib import Path

from bubbles.demo.orchestrate.processes import free_port
from helpers.operator_kube import until

SCRAPE_S = 1.0  # and as long a timeout: the demo's agent answered one scrape in 0.56 s on a loaded machine
RATE_INTERVAL = "4s"  # what Grafana's $__rate_interval is for a 1 s scrape interval (4 x scrape)


def find_prometheus() -> tuple[str | None, str]:
    given = os.environ.get("BUBBLES_PROMETHEUS")
    if given:
        return (given, "") if os.access(given, os.X_OK) else (None, f"BUBBLES_PROMETHEUS={given} is not executable")
    found = shutil.which("prometheus")
    return (found, "") if found else (None, "no prometheus binary (run tools/prometheus-from-debian.sh as root, "
                                            "or set BUBBLES_PROMETHEUS)")


class Prometheus:
    def __init__(self, binary: str, work: Path, targets: dict[str, list[tuple[str, dict[str, str]]]],
                 scrape_configs: list[dict[str, object]] = ()) -> None:  # type: ignore[assignment]
        """Scrape ``targets`` (job -> [(host:port, labels)]) and any further ``scrape_configs`` every second."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {"global": {"scrape_interval": f"{int(SCRAPE_S * 1000)}ms",
                             "scrape_timeout": f"{int(SCRAPE_S * 1000)}ms"},
                  "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [t], "labels": labels}
                                                                          for t, labels in ts]}
                                     for job, ts in targets.items()] + list(scrape_configs)}
        (work / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self.log = (work / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"], stdout=self.log, stderr=subprocess.STDOUT)
        until("Prometheus ready", self._ready, timeout_s=30)

    def _ready(self) -> bool:
        assert self.proc.poll() is None, f"prometheus exited: {Path(self.log.name).read_text()[-2000:]}"
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def targets_up(self) -> dict[str, str]:
        """Each target's health ("up", or the last scrape's error)."""
        with urllib.request.urlopen(f"{self.url}/api/v1/targets", timeout=5) as r:
            active = json.load(r)["data"]["activeTargets"]
        return {t["scrapeUrl"]: t["health"] if t["health"] == "up" else t.get("lastError") or t["health"]
                for t in active}

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
