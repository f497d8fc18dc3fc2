"""The agent's configuration: one frozen, self-validating ``AgentConfig``, loaded in one place.

``load_settings`` merges, in this order (a later source wins): built-in defaults, a YAML file
(``--config FILE``), the environment (``BUBBLES_AGENT_<KEY>``; ``BUBBLES_RUN_DIR`` and ``BUBBLES_TRAINING``
too, which the training's hook reads as well), and the command line's flags. Every key has one name in all
three, the flag's without its dashes (``grace_ms``, ``metrics_port``, ``mps_pipe_dir``...). A bad value
raises ``ConfigError`` naming the flag and where the value came from.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bubbles.core import paths
from bubbles.core.api import (
    DEFAULT_CUDA_CONTEXT_MIB,
    FillMode,
    IsolationMode,
    check_cuda_context_mib,
    check_tail_risk,
    read_yaml,
)
from bubbles.core.mps_client import DEFAULT_FILL_THREAD_PERCENTAGE

from . import podresources
from .core import CoreConfig
from .csi import DEFAULT_KUBELET_DIR, csi_socket, registration_socket, socket_problem
from .deviceplugin.decide import DEFAULT_FILL_SLOTS, GpuStrategy, check_fill_slots
from .guard import GuardConfig
from .isolation import IsolationConfig
from .launcher import assign_device, parse_devices

ENV_PREFIX = "BUBBLES_AGENT_"


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the flag and the fix."""


@dataclass(frozen=True)
class AgentConfig:
    """Everything one agent process is configured with; invalid values raise ``ConfigError`` here."""

    run_dir: Path
    training: str
    executors: int = 1
    mode: FillMode = FillMode.HARVEST
    grace_s: float = 0.050
    init_timeout_s: float = 600.0  # an SDK job still in its init this long after its start is killed
    relaunch: bool = True  # restart a job stopped by an isolation loss itself (False in cluster mode: the operator)
    budget: float = 0.01
    tail_risk: float | None = None  # the training's limit on fill steps past a predicted end; None: the jobs' own
    pin_cores: bool = True
    metrics: bool = False  # serve Prometheus metrics
    metrics_port: int = 9400  # its TCP port; 0: any free port (the ready file says which)
    metrics_addr: str = "127.0.0.1"
    ready_file: Path | None = None
    guard: GuardConfig | None = None  # default: GuardConfig(budget=budget)
    devices: tuple[str, ...] = ()  # "cpu" | "cuda:N", executor k gets devices[k % len]; () = CPU core k
    isolation: IsolationConfig = field(default_factory=IsolationConfig)
    cuda_context_mib: int = DEFAULT_CUDA_CONTEXT_MIB  # a GPU fill process's own CUDA context (not under MPS)
    exit_when_done: bool = False  # stop, with the stats and a summary, once the training has ended (local mode)
    start_timeout_s: float | None = None  # with exit_when_done: give up if no stage started this long after the start
    # The training's namespace. No flag sets it: a local agent serves a training outside Kubernetes, whose hook writes
    # under ``_local`` (``paths.default_namespace`` without $POD_NAMESPACE); in a cluster the node agent takes it
    # from each training's cards. A flag could only name a directory no hook writes to.
    namespace: str = paths.LOCAL_NAMESPACE

    def __post_init__(self) -> None:
        if isinstance(self.executors, bool) or not isinstance(self.executors, int) or self.executors < 1:
            raise ConfigError(f"--executors must be >= 1 (one per local pipeline stage), got {self.executors}")
        try:
            paths.check_name("training", self.training)
            paths.check_namespace(self.namespace)
            object.__setattr__(self, "mode", FillMode.parse(self.mode, "--mode"))
            for d in self.devices:
                parse_devices(d)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if not self.grace_s > 0:
            raise ConfigError(f"--grace-ms must be > 0, got {self.grace_s * 1e3:g}")
        if not 0 < self.init_timeout_s <= 86400:
            raise ConfigError(f"--init-timeout must be > 0 seconds and at most a day (how long a fill job's init may "
                              f"take), got {self.init_timeout_s:g}")
        try:
            check_cuda_context_mib(self.cuda_context_mib, "--cuda-context-mib")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if not 0 < self.budget < 1:
            raise ConfigError(f"--slowdown-budget must be a fraction in (0, 1) (0.01 = 1%), got {self.budget}")
        if self.tail_risk is not None:
            try:
                check_tail_risk(self.tail_risk, "--tail-risk")
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        if not isinstance(self.exit_when_done, bool):
            raise ConfigError(f"--exit-when-done is a switch (true or false), got {self.exit_when_done!r}")
        if self.start_timeout_s is not None:
            if not self.exit_when_done:
                raise ConfigError("--start-timeout only applies with --exit-when-done (how long the agent waits for "
                                  "its training to start before it gives up); give both, or neither")
            if not 0 < self.start_timeout_s <= 86400:
                raise ConfigError(f"--start-timeout must be > 0 seconds and at most a day (how long to wait for the "
                                  f"training's first stage to start), got {self.start_timeout_s:g}")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port must be a TCP port (0 = any free port), got {self.metrics_port}")

    @property
    def guard_config(self) -> GuardConfig:
        return self.guard or GuardConfig(budget=self.budget)

    def executor_devices(self) -> tuple[tuple[str, int | None], ...]:
        """(device, CPU core or None) per executor."""
        return tuple(assign_device(k, self.devices, self.pin_cores) for k in range(self.executors))

    def core(self) -> CoreConfig:
        """What the pure core needs of this configuration."""
        return CoreConfig(run_dir=self.run_dir, training=self.training, executors=self.executor_devices(),
                          mode=self.mode, grace_s=self.grace_s, guard=self.guard_config,
                          isolation_mode=self.isolation.mode, allow_unisolated=self.isolation.allow_unisolated,
                          tail_risk=self.tail_risk, init_timeout_s=self.init_timeout_s, relaunch=self.relaunch,
                          cuda_context_bytes=self.cuda_context_mib << 20, exit_when_done=self.exit_when_done,
                          start_timeout_s=self.start_timeout_s, namespace=self.namespace)


@dataclass(frozen=True)
class CsiSettings:
    """``--csi`` (issue 36, step 1): serve the CSI node plugin ``csi.bubbles.dev`` and register it with the kubelet
    (``bubbles.agent.csi``). Its sockets and the Pods' targets are under the kubelet's directory (its --root-dir)."""

    kubelet_dir: Path = DEFAULT_KUBELET_DIR

    def __post_init__(self) -> None:
        d = self.kubelet_dir
        if not paths.is_plain_absolute(str(d)):
            raise ConfigError(f"--kubelet-dir must be an absolute path written plainly (the kubelet's --root-dir, "
                              f"default {DEFAULT_KUBELET_DIR}), got {str(d)!r}")
        if not d.is_dir():
            what = "is not a directory" if d.exists() else "does not exist"
            raise ConfigError(f"--kubelet-dir {d} {what}: give the kubelet's --root-dir (default "
                              f"{DEFAULT_KUBELET_DIR}), mounted into the agent's container at the same path")
        for sock in (csi_socket(d), registration_socket(d)):
            problem = socket_problem(sock)
            if problem is not None:
                raise ConfigError(problem)


@dataclass(frozen=True)
class ClusterSettings:
    """``--cluster``: serve every training on this node and the operator's gRPC calls (``bubbles.agent.cluster``)."""

    node: str
    listen: str = "0.0.0.0:7070"
    health_listen: str | None = None  # plain-text grpc.health.v1 only, for kubelet probes
    tls_cert: Path | None = None
    tls_key: Path | None = None
    client_ca: Path | None = None
    token_file: Path | None = None
    gpus: tuple[tuple[str, str], ...] = ()  # (GPU UUID, "cuda:N") given by --gpus; NVML is asked when empty
    csi: CsiSettings | None = None  # --csi: the CSI node plugin (issue 36, step 1); off by default
    device_plugin: DevicePluginSettings | None = None  # --device-plugin

    def __post_init__(self) -> None:
        if not self.node:
            raise ConfigError("--cluster needs the node's name: --node NAME, or $BUBBLES_AGENT_NODE (the chart sets "
                              "it from spec.nodeName)")
        for flag, addr in (("--listen", self.listen), ("--health-listen", self.health_listen)):
            if addr is None:
                continue
            host, sep, port = addr.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
                raise ConfigError(f"{flag} must be HOST:PORT (e.g. 0.0.0.0:7070), got {addr!r}")
        if self.tls_cert is None or self.tls_key is None:
            raise ConfigError("--cluster serves the operator over TLS only: give --tls-cert and --tls-key (the "
                              "chart mounts them from its Secret)")
        if self.client_ca is None and self.token_file is None:
            raise ConfigError("--cluster must authenticate the operator: give --client-ca (mutual TLS) or "
                              "--token-file (a bearer token), or both")
        for flag, f in (("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key), ("--client-ca", self.client_ca),
                        ("--token-file", self.token_file)):
            if f is not None and not f.is_file():
                raise ConfigError(f"{flag} {f} does not exist or is not a file")


@dataclass(frozen=True)
class DevicePluginSettings:
    """``--device-plugin``: serve the kubelet each GPU of the node as an extended resource of fill slots
    (``bubbles.agent.deviceplugin``). Step 1 of issue 36: the operator's fill Pods do not request these yet."""

    strategy: GpuStrategy = GpuStrategy.CDI
    fill_slots: int = DEFAULT_FILL_SLOTS
    directory: Path = Path("/var/lib/kubelet/device-plugins")
    # The kubelet's PodResources API, asked in PreStartContainer whose Pod a container is; None: the one beside
    # ``directory`` (<root-dir>/pod-resources/kubelet.sock).
    pod_resources_socket: Path | None = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "strategy", GpuStrategy.parse(self.strategy, "--gpu-strategy"))
            check_fill_slots(self.fill_slots, "--fill-slots")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if not self.directory.is_absolute():
            raise ConfigError(f"--device-plugin-dir must be an absolute path (the kubelet's device-plugins directory, "
                              "/var/lib/kubelet/device-plugins: the kubelet fixes it whatever its --root-dir), got "
                              f"{self.directory}")
        if self.pod_resources_socket is None:
            object.__setattr__(self, "pod_resources_socket", podresources.socket_beside(self.directory))
        assert self.pod_resources_socket is not None
        if (problem := podresources.socket_problem(self.pod_resources_socket)) is not None:
            raise ConfigError(problem)


DEVICE_PLUGIN_KEYS = ("gpu_strategy", "fill_slots", "device_plugin_dir", "pod_resources_socket")


def device_plugin_settings(v: Mapping[str, Any]) -> DevicePluginSettings | None:
    """The device plugin's settings from the merged keys, None when it is off; ConfigError for a setting without
    ``--device-plugin`` or ``--device-plugin`` without ``--cluster``."""
    if not v.get("device_plugin", False):
        extra = [_flag(k) for k in DEVICE_PLUGIN_KEYS if v.get(k) is not None]
        if extra:
            raise ConfigError(f"{', '.join(extra)} only apply with --device-plugin")
        return None
    if not v.get("cluster", False):
        raise ConfigError("--device-plugin only applies with --cluster (the node's agent, as a DaemonSet, serves the "
                          "kubelet its GPUs)")
    return DevicePluginSettings(strategy=v.get("gpu_strategy", GpuStrategy.CDI),
                                fill_slots=v.get("fill_slots", DEFAULT_FILL_SLOTS),
                                directory=v.get("device_plugin_dir", Path("/var/lib/kubelet/device-plugins")),
                                pod_resources_socket=v.get("pod_resources_socket"))


def parse_gpus(text: str) -> tuple[tuple[str, str], ...]:
    """``--gpus``: ``UUID=cuda:N`` entries, comma-separated; ValueError saying what is wrong."""
    out = []
    for entry in (e.strip() for e in text.split(",")):
        uuid, sep, device = entry.partition("=")
        if not sep or not uuid.startswith("GPU-") or parse_devices(device) != (device,) or device == "cpu":
            raise ValueError(f"--gpus entry {entry!r} is not GPU-<uuid>=cuda:N (nvidia-smi -L lists the UUIDs)")
        out.append((uuid, device))
    return tuple(out)


@dataclass(frozen=True)
class AgentSettings:
    """What ``bubbles agent`` runs with: the configuration plus the command's own inputs and outputs."""

    config: AgentConfig
    fill_jobs: tuple[Path, ...] = ()
    stats: Path | None = None
    log_level: str = "INFO"
    cluster: ClusterSettings | None = None


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def _as_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"expected an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        return int(value.strip())
    raise ValueError(f"expected an integer, got {value!r}")


def _as_float(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {value!r}")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        return float(value.strip())
    raise ValueError(f"expected a number, got {value!r}")


def _as_str(value: Any) -> str:
    if isinstance(value, str) and value.strip():
        return value.strip()
    raise ValueError(f"expected a non-empty string, got {value!r}")


def _as_path(value: Any) -> Path:
    return Path(_as_str(value) if not isinstance(value, Path) else value)


def _as_devices(value: Any) -> tuple[str, ...]:
    if isinstance(value, list | tuple):
        value = ",".join(map(str, value))
    return parse_devices(_as_str(value))


def _as_paths(value: Any) -> tuple[Path, ...]:
    if isinstance(value, str):
        value = [v for v in value.split(os.pathsep) if v]
    if not isinstance(value, list | tuple):
        raise ValueError(f"expected a list of paths, got {value!r}")
    return tuple(_as_path(v) for v in value)


# key -> how a value from the file or the environment is read (flags arrive typed from argparse)
KEYS: dict[str, Callable[[Any], Any]] = {
    "run_dir": _as_path, "training": _as_str, "executors": _as_int, "fill_job": _as_paths, "mode": _as_str,
    "grace_ms": _as_float, "init_timeout": _as_float, "cuda_context_mib": _as_int, "slowdown_budget": _as_float,
    "tail_risk": _as_float, "exit_when_done": _as_bool, "start_timeout": _as_float,
    "pin_cores": _as_bool, "metrics": _as_bool,
    "metrics_port": _as_int, "metrics_addr": _as_str, "stats": _as_path, "ready_file": _as_path,
    "log_level": _as_str, "devices": _as_devices, "isolation": _as_str, "allow_unisolated": _as_bool,
    "mps_control": _as_str, "mps_pipe_dir": _as_path, "mps_log_dir": _as_path, "mps_thread_percentage": _as_int,
    "mps_check_interval": _as_float, "mps_daemon": _as_str,
    "cluster": _as_bool, "node": _as_str, "listen": _as_str, "health_listen": _as_str, "tls_cert": _as_path,
    "tls_key": _as_path, "client_ca": _as_path, "token_file": _as_path, "gpus": lambda v: parse_gpus(_as_str(v)),
    "csi": _as_bool, "kubelet_dir": _as_path,
    "device_plugin": _as_bool, "gpu_strategy": _as_str, "fill_slots": _as_int, "device_plugin_dir": _as_path,
    "pod_resources_socket": _as_path,
}
LEGACY_ENV = {"run_dir": "BUBBLES_RUN_DIR", "training": "BUBBLES_TRAINING"}


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _read(key: str, value: Any, where: str) -> Any:
    try:
        return KEYS[key](value)
    except ValueError as exc:
        message = str(exc)
        if not message.startswith(_flag(key)):
            message = f"{_flag(key)} {where}: {message}"
        raise ConfigError(message) from None


def load_file(path: Path) -> dict[str, Any]:
    """The keys of a YAML configuration file, read and checked; ConfigError for a missing or bad file."""
    data = read_yaml(path, "the agent configuration", ConfigError)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the agent configuration must be a mapping of keys like executors: 2")
    unknown = sorted(set(map(str, data)) - set(KEYS))
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(unknown)}; known keys: {', '.join(sorted(KEYS))}")
    return {k: _read(k, v, f"in {path}") for k, v in data.items()}


def merge_sources(flags: Mapping[str, Any], environ: Mapping[str, str], config_file: Path | None) -> dict[str, Any]:
    """File, then environment, then flags (``None`` in ``flags``: not given): the winning value of each key."""
    values: dict[str, Any] = load_file(config_file) if config_file is not None else {}
    for key in KEYS:
        for name in (ENV_PREFIX + key.upper(), LEGACY_ENV.get(key)):
            if name and environ.get(name):
                values[key] = _read(key, environ[name], f"from ${name}")
                break
    values.update({k: _read(k, v, "on the command line") for k, v in flags.items() if k in KEYS and v is not None})
    return values


def load_settings(flags: Mapping[str, Any], environ: Mapping[str, str] | None = None,
                  config_file: Path | None = None) -> AgentSettings:
    """The agent's settings from its three sources (see the module's documentation); ConfigError if invalid."""
    v = merge_sources(flags, os.environ if environ is None else environ, config_file)
    metrics_port = v.get("metrics_port")
    try:
        isolation = IsolationConfig(
            mode=v.get("isolation", IsolationMode.CONTEXTS), allow_unisolated=v.get("allow_unisolated", False),
            mps_control=v.get("mps_control"), mps_pipe_dir=v.get("mps_pipe_dir"), mps_log_dir=v.get("mps_log_dir"),
            mps_thread_percentage=v.get("mps_thread_percentage", DEFAULT_FILL_THREAD_PERCENTAGE),
            check_interval_s=v.get("mps_check_interval", 1.0), mps_daemon=v.get("mps_daemon", "own"))
    except ValueError as exc:
        message = str(exc)
        for said, flag in (("MPS active thread percentage", "--mps-thread-percentage"),
                           ("isolation check interval must be > 0 s,", "--mps-check-interval must be > 0 seconds,"),
                           ("isolation mode", "--isolation"), ("MPS daemon must be", "--mps-daemon must be")):
            message = message.replace(said, flag)
        raise ConfigError(message) from None
    config = AgentConfig(
        run_dir=v.get("run_dir") or paths.default_run_dir(),
        training=v.get("training") or paths.default_training(),
        executors=v.get("executors", 1),
        mode=v.get("mode", FillMode.HARVEST),
        grace_s=v.get("grace_ms", 50.0) / 1e3,
        init_timeout_s=v.get("init_timeout", 600.0),
        budget=v.get("slowdown_budget", 0.01),
        tail_risk=v.get("tail_risk"),
        pin_cores=v.get("pin_cores", True),
        # --metrics-port alone turns the endpoint on; --no-metrics turns it off whatever the port.
        metrics=v.get("metrics", metrics_port is not None),
        metrics_port=9400 if metrics_port is None else metrics_port,
        metrics_addr=v.get("metrics_addr", "127.0.0.1"),
        ready_file=v.get("ready_file"),
        devices=v.get("devices", ()),
        isolation=isolation,
        cuda_context_mib=v.get("cuda_context_mib", DEFAULT_CUDA_CONTEXT_MIB),
        exit_when_done=v.get("exit_when_done", False),
        start_timeout_s=v.get("start_timeout"),
    )
    device_plugin = device_plugin_settings(v)
    cluster = None
    if v.get("cluster", False):
        if config.exit_when_done:
            raise ConfigError("--exit-when-done is for local mode, beside one training; in a cluster the agent serves "
                              "every training on its node for as long as the node runs (leave it out with --cluster)")
        if v.get("fill_job"):
            raise ConfigError("--fill-job is for local mode; in a cluster the operator assigns fill jobs (FillJob "
                              "resources)")
        csi = None
        if v.get("csi", False):
            csi = CsiSettings(kubelet_dir=v.get("kubelet_dir", DEFAULT_KUBELET_DIR))
        elif v.get("kubelet_dir") is not None:
            raise ConfigError("--kubelet-dir only applies with --csi (where the CSI node plugin finds the kubelet)")
        cluster = ClusterSettings(node=v.get("node", ""), listen=v.get("listen", "0.0.0.0:7070"),
                                  health_listen=v.get("health_listen"), tls_cert=v.get("tls_cert"),
                                  tls_key=v.get("tls_key"), client_ca=v.get("client_ca"),
                                  token_file=v.get("token_file"), gpus=v.get("gpus", ()), csi=csi,
                                  device_plugin=device_plugin)
    else:
        extra = sorted([k for k in ("node", "listen", "health_listen", "tls_cert", "tls_key", "client_ca",
                                    "token_file", "gpus", "kubelet_dir") if v.get(k) is not None]
                       + (["csi"] if v.get("csi", False) else []))
        if extra:
            raise ConfigError(f"{', '.join(_flag(k) for k in extra)} only apply with --cluster")
    return AgentSettings(config, fill_jobs=tuple(v.get("fill_job", ())), stats=v.get("stats"),
                         log_level=v.get("log_level", "INFO"), cluster=cluster)
