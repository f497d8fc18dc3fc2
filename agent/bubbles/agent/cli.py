"""``bubbles agent``: run the node agent for one training on this machine.

Starts one executor per local pipeline stage (its rank 0), binds
``<run_dir>/_local/<training>/stage-<k>/rank-0/agent.sock``, writes ``--ready-file`` once every socket is bound, and
serves until SIGTERM/SIGINT; then it stops the fill jobs, writes ``--stats`` and exits 0. The stages' other ranks
(tensor- and data-parallel), and stages beyond ``--executors``, are served as their hooks' cards appear (read every
second). With ``--exit-when-done`` it also stops by itself once the training it serves has ended (every GPU's hook
gone: detached, or its process dead), prints a summary of what was harvested to stderr and exits 0; with
``--start-timeout`` it gives up, exit 1, when no GPU started in time. Bad input (no such
spec file, an invalid spec,
``--executors 0``, a bad ``--devices`` entry, an ``--mps-control`` that is not an executable) exits 2
with a message saying what to fix.

``--cluster --csi`` also serves the CSI node plugin ``csi.bubbles.dev`` and registers it with the kubelet
(``bubbles.agent.csi``; issue 36): the node agent reads the hook cards of training Pods in their own volumes'
directories; a fill Pod's volume is published only for the operator's assigned fill Pods, and carries the Pod's own
attach socket; with ``--isolation mps`` every Pod's volume also carries the MPS pipe directory and the agent's
/dev/shm (at ``mps/pipe``, ``mps/shm``). ``--cluster --device-plugin`` serves each GPU as an extended resource
(``bubbles.agent.deviceplugin``), which the agent's reports name per GPU, and lets a container holding one start only
if the kubelet's PodResources API (``--pod-resources-socket``) says its Pod is a fill Pod assigned that GPU.

Isolation (``--isolation contexts|mps|none``, docs/gpu.md) fails closed: while the chosen mode does
not work, fill jobs wait and the status says why, unless ``--allow-unisolated`` is given.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from bubbles.core.api import FillMode, IsolationMode
from bubbles.core.nodeaccess import resource_name

from .config import AgentConfig, ClusterSettings
from .deviceplugin.decide import GpuStrategy

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .csi.publish import MpsDirs
    from .deviceplugin.decide import NodeGpu
    from .deviceplugin.guard import FillPodGpus
    from .deviceplugin.shell import DevicePlugins


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Defaults live in AgentConfig, not here: a flag left out (None) lets the file or the environment decide.
    parser.add_argument("--config", type=Path, default=None, metavar="FILE",
                        help="YAML file of settings, keys named as the flags (executors: 2, grace_ms: 50, ...); "
                             "the environment (BUBBLES_AGENT_<KEY>) overrides it, flags override both")
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="directory of the node-local sockets (default: $BUBBLES_RUN_DIR, "
                             "/run/bubbles or /tmp/bubbles-<uid>)")
    parser.add_argument("--training", default=None,
                        help="training name (default: $BUBBLES_TRAINING or 'default')")
    parser.add_argument("--executors", type=int, default=None,
                        help="executors, one per local pipeline stage (default 1; CPU: executor k uses core "
                             "k %% cores)")
    parser.add_argument("--fill-job", action="append", default=None, metavar="FILE", type=Path,
                        help="fill-job spec (YAML or JSON); repeatable")
    parser.add_argument("--mode", choices=list(FillMode.labels()), default=None,
                        help="initial fill mode (default harvest); the training's FILL_MODE messages switch it "
                             "per stage")
    parser.add_argument("--grace-ms", type=float, default=None,
                        help="SIGKILL a fill job still in a step this long after its bubble ended (default 50)")
    parser.add_argument("--init-timeout", type=float, default=None, metavar="SECONDS",
                        help="SIGKILL a fill job whose init (loading its model, its data) has not finished this long "
                             "after its start: it holds its stage (default 600; a job's own spec.initTimeout or "
                             "init_timeout takes its place)")
    parser.add_argument("--slowdown-budget", type=float, default=None,
                        help="training slowdown the guard tolerates (default 0.01 = 1%%)")
    parser.add_argument("--tail-risk", type=float, default=None,
                        help="the most risk a fill step started past a bubble's predicted end may take of outliving "
                             "the bubble, 0 to 0.5 (0: never start one); caps each fill job's own $BUBBLES_TAIL_RISK "
                             "(default: no cap, the jobs' own, 0.1 unless set). In a cluster a PipelineTraining's "
                             "spec.tailRisk replaces it for that training")
    parser.add_argument("--pin-cores", action=argparse.BooleanOptionalAction, default=None,
                        help="pin executor k's fill processes to CPU core k %% cores (default on)")
    parser.add_argument("--metrics", action=argparse.BooleanOptionalAction, default=None,
                        help="serve Prometheus metrics (default: on when --metrics-port is given)")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="Prometheus port; 0 picks any free port (the ready file says which). Giving it turns "
                             "metrics on")
    parser.add_argument("--metrics-addr", default=None, help="Prometheus bind address (default 127.0.0.1)")
    parser.add_argument("--stats", type=Path, default=None, help="write the stats JSON here on exit")
    parser.add_argument("--exit-when-done", action=argparse.BooleanOptionalAction, default=None,
                        help="stop once the training has ended (every stage's hook gone: detach() removed its card, "
                             "or its process died), as on SIGTERM: stop the fill jobs, write --stats, print a summary "
                             "of what was harvested per stage to stderr, exit 0 (default off: serve until SIGTERM). "
                             "Local mode only")
    parser.add_argument("--start-timeout", type=float, default=None, metavar="SECONDS",
                        help="with --exit-when-done: give up (stats and summary written, exit 1) when no stage of the "
                             "training has started this long after the agent's start (default: wait as long as it "
                             "takes)")
    parser.add_argument("--ready-file", type=Path, default=None,
                        help="written once every socket is bound (wait for it before starting the training)")
    parser.add_argument("--log-level", default=None, choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    cl = parser.add_argument_group("cluster mode (a DaemonSet: every training on the node, called by the operator)")
    cl.add_argument("--cluster", action="store_const", const=True, default=None,
                    help="serve every training whose hook runs on this node, and the operator's gRPC calls; fill "
                         "Pods attach to <run-dir>/_attach/attach.sock (--training and --executors are then per "
                         "training)")
    cl.add_argument("--node", default=None, help="this node's name (the chart sets $BUBBLES_AGENT_NODE)")
    cl.add_argument("--listen", default=None, metavar="HOST:PORT",
                    help="gRPC address for the operator (TLS; default 0.0.0.0:7070)")
    cl.add_argument("--health-listen", default=None, metavar="HOST:PORT",
                    help="plain-text grpc.health.v1 only, for kubelet probes (default: none; health is also served "
                         "on --listen)")
    cl.add_argument("--tls-cert", type=Path, default=None, metavar="FILE", help="the agent's server certificate")
    cl.add_argument("--tls-key", type=Path, default=None, metavar="FILE", help="its private key")
    cl.add_argument("--client-ca", type=Path, default=None, metavar="FILE",
                    help="CA of the operator's client certificate: mutual TLS is then required")
    cl.add_argument("--token-file", type=Path, default=None, metavar="FILE",
                    help="a bearer token the operator must send (the fallback without client certificates)")
    cl.add_argument("--gpus", default=None, metavar="LIST",
                    help="GPU-<uuid>=cuda:N entries, comma-separated, where NVML is not available (default: NVML)")
    cl.add_argument("--csi", action="store_const", const=True, default=None,
                    help="serves the CSI node plugin csi.bubbles.dev (each Pod's inline volume "
                         "is <run-dir>/_pods/<pod uid>/, bind-mounted) and registers it with the kubelet; the chart "
                         "passes it with agent.csi.enabled (default off; docs/agent.md)")
    cl.add_argument("--kubelet-dir", type=Path, default=None, metavar="DIR",
                    help="with --csi: the kubelet's --root-dir, mounted at the same path (default /var/lib/kubelet): "
                         "the CSI socket in plugins/csi.bubbles.dev/, the registration socket in plugins_registry/, "
                         "and every volume's target under pods/")
    dp = parser.add_argument_group("device plugin (with --cluster; issue 36, step 1: the operator's fill Pods do not "
                                   "request these resources yet; docs/agent.md)")
    dp.add_argument("--device-plugin", action="store_const", const=True, default=None,
                    help="serve the kubelet a device plugin: each GPU of the node as the extended resource "
                         "bubbles.dev/gpu-<index>, with --fill-slots devices; a container holding one starts only "
                         "if its Pod is a fill Pod assigned that GPU (asked of --pod-resources-socket) (default off)")
    dp.add_argument("--gpu-strategy", choices=[s.value for s in GpuStrategy], default=None,
                    help="how the kubelet hands a fill Pod its GPU: cdi (default; CDI devices, Kubernetes 1.28+ with "
                         "a CDI runtime), cdi-annotations, volume-mounts or envvar (NVIDIA's runtime)")
    dp.add_argument("--fill-slots", type=int, default=None, metavar="K",
                    help="how many fill Pods may share one GPU at once: the devices of its resource (default 4)")
    dp.add_argument("--device-plugin-dir", type=Path, default=None, metavar="DIR",
                    help="the kubelet's device-plugins directory (default /var/lib/kubelet/device-plugins)")
    dp.add_argument("--pod-resources-socket", type=Path, default=None, metavar="PATH",
                    help="the kubelet's PodResources API, asked before each container holding a GPU's slots starts "
                         "which Pod it is (default: pod-resources/kubelet.sock beside --device-plugin-dir, "
                         "/var/lib/kubelet/pod-resources/kubelet.sock); its directory mounted from the host")
    gpu = parser.add_argument_group("devices and isolation (see docs/gpu.md)")
    gpu.add_argument("--devices", default=None, metavar="LIST",
                     help="comma-separated cpu or cuda:N, one per executor (executor k gets entry k %% len); "
                          "default: CPU core k stands in for stage k's accelerator")
    gpu.add_argument("--isolation", choices=list(IsolationMode.labels()), default=None,
                     help="contexts (default): separate CUDA contexts, a fault in a fill job stays in that job; "
                          "mps: MPS clients with enforced memory limits and concurrent kernels, but one fault "
                          "domain with the training; none: unisolated sharing")
    gpu.add_argument("--allow-unisolated", action="store_const", const=True, default=None,
                     help="run fill jobs even while the chosen isolation does not work (status says "
                          "'unisolated'); default: fail closed, fill jobs wait")
    gpu.add_argument("--cuda-context-mib", type=int, default=None, metavar="MIB",
                     help="what a fill process's own CUDA context takes on its GPU beside its memory limit (the "
                          "allocator cap), planned on top of it outside MPS (default 512)")
    gpu.add_argument("--mps-control", default=None, metavar="PATH",
                     help="the MPS control program (default: nvidia-cuda-mps-control on PATH)")
    gpu.add_argument("--mps-daemon", choices=["own", "external"], default=None,
                     help="own (default): start the MPS control daemon when none answers, and stop it at exit "
                          "unless a client uses it; external: another component runs it (the chart's mps-daemon "
                          "DaemonSet), and the agent never starts, stops or kills one")
    gpu.add_argument("--mps-pipe-dir", type=Path, default=None, metavar="DIR",
                     help="MPS pipe directory, shared with the training (default: $CUDA_MPS_PIPE_DIRECTORY or "
                          "/tmp/nvidia-mps)")
    gpu.add_argument("--mps-log-dir", type=Path, default=None, metavar="DIR",
                     help="MPS log directory (default: $CUDA_MPS_LOG_DIRECTORY or /var/log/nvidia-mps; a "
                          "directory under the run dir if that is not writable)")
    gpu.add_argument("--mps-thread-percentage", type=int, default=None, metavar="P",
                     help="CUDA_MPS_ACTIVE_THREAD_PERCENTAGE of each fill client, 1..100 (default 50)")
    gpu.add_argument("--mps-check-interval", type=float, default=None, metavar="SECONDS",
                     help="seconds between MPS daemon health checks (default 1)")


def _fail(message: str) -> int:
    print(f"bubbles agent: error: {message}", file=sys.stderr)
    return 2


def _path_problem(config: AgentConfig) -> str | None:
    """What is wrong with the paths the isolation will use (checked before anything starts), or None."""
    iso = config.isolation
    if iso.mps_control is not None:
        ctl = Path(iso.mps_control)
        if not ctl.is_file():
            return (f"--mps-control {ctl} does not exist; give the path of nvidia-cuda-mps-control "
                    "(or leave it out to find it on PATH)")
        if not os.access(ctl, os.X_OK):
            return f"--mps-control {ctl} is not executable; chmod +x it or give the right path"
    for flag, d in (("--mps-pipe-dir", iso.mps_pipe_dir), ("--mps-log-dir", iso.mps_log_dir)):
        if d is not None and d.exists() and not d.is_dir():
            return f"{flag} {d} is a file, not a directory; give a directory"
    return None


def run(args: argparse.Namespace) -> int:
    from bubbles.core.api import SpecError, load_spec

    from .config import ConfigError, load_settings
    from .server import Agent

    try:
        settings = load_settings(vars(args), config_file=args.config)
    except ConfigError as exc:
        return _fail(str(exc))
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = settings.config
    problem = _path_problem(config)
    if problem is not None:
        return _fail(problem)
    if settings.cluster is not None:
        return run_cluster(settings.config, settings.cluster)
    specs = []
    for f in settings.fill_jobs:
        try:
            specs.append(load_spec(f))
        except SpecError as exc:
            return _fail(str(exc))
    try:
        agent = Agent(config, specs)
    except ValueError as exc:
        return _fail(str(exc))
    try:
        agent.start()
    except OSError as exc:
        return _fail(f"cannot bind the agent's sockets under {config.run_dir}: {exc}")

    def on_signal(signum: int, _frame: object) -> None:
        agent.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        agent.run()
    finally:
        if settings.stats is not None:
            agent.write_stats(settings.stats)
            logging.getLogger("bubbles.agent").info("stats written to %s", settings.stats)
    if config.exit_when_done:
        where = f"\n  stats: {settings.stats}" if settings.stats is not None else ""
        print(agent.summary() + where, file=sys.stderr, flush=True)
    ended = agent.ended
    return ended.code if ended is not None else 0


def run_cluster(template: AgentConfig, cluster: ClusterSettings) -> int:
    """``--cluster``: the node's trainings, the attach socket and the gRPC service, until SIGTERM/SIGINT."""
    import threading

    from .cluster import ClusterConfig, NodeAgent
    from .gpus import discover_gpus
    from .rpc import SecurityError, ServerSecurity, serve

    log = logging.getLogger("bubbles.agent")
    gpus = dict(cluster.gpus) or discover_gpus()
    # The device plugin and the CSI node plugin's book come first: the node agent's first scan reads the training
    # Pods' directories the book names (an agent restarted finds the running trainings again), and its reports
    # name each GPU's resource from the start. Both ask the node agent later (which fill Pods are assigned where):
    # through ``agents``, filled once it exists; until then no container holding a GPU's slot starts.
    agents: list[NodeAgent] = []
    plugins = None
    if cluster.device_plugin is not None:
        try:
            plugins = start_device_plugin(cluster, lambda: agents[0].fill_pod_gpus() if agents else ())
        except OSError as exc:
            return _fail(str(exc))
    csi_plugin = None
    if cluster.csi is not None:
        from .csi.plugin import CsiNodePlugin

        try:
            csi_plugin = CsiNodePlugin(cluster.node, template.run_dir, cluster.csi.kubelet_dir,
                                       mps=csi_mps_dirs(template))
        except ValueError as exc:
            if plugins is not None:
                plugins.stop()
            return _fail(f"cannot serve the CSI node plugin (--csi): {exc}")
    node = NodeAgent(ClusterConfig(cluster.node, template, gpus),
                     pods=csi_plugin.published if csi_plugin is not None else None,
                     gpu_resources=device_plugin_resources(plugins) if plugins is not None else None)
    agents.append(node)
    if csi_plugin is not None:
        # The node agent admits fill volumes (only its assigned fill Pods') and serves each fill Pod's own attach
        # socket in its directory; start() hands it the fill volumes an earlier agent published.
        csi_plugin.fill_pods = node
        try:
            csi_plugin.start()
        except OSError as exc:
            if plugins is not None:
                plugins.stop()
            return _fail(f"cannot serve the CSI node plugin (--csi): {exc}")
    security = ServerSecurity(cluster.tls_cert, cluster.tls_key, cluster.client_ca, cluster.token_file)
    try:
        node.start()
    except OSError as exc:
        if plugins is not None:
            plugins.stop()
        return _fail(f"cannot bind the attach socket under {template.run_dir}: {exc}")
    if template.metrics:
        try:
            node.serve_metrics(template.metrics_port, template.metrics_addr)
        except OSError as exc:
            node.stop()
            if plugins is not None:
                plugins.stop()
            return _fail(f"cannot serve metrics on {template.metrics_addr}:{template.metrics_port}: {exc}")
    csi_server = None
    if csi_plugin is not None:
        from .csi import csi_socket, registration_socket
        from .csi.server import serve as serve_csi

        kubelet_dir = csi_plugin.kubelet_dir
        try:
            csi_server = serve_csi(csi_plugin, csi_socket(kubelet_dir), registration_socket(kubelet_dir))
        except OSError as exc:
            node.stop()
            if plugins is not None:
                plugins.stop()
            return _fail(f"cannot serve the CSI node plugin (--csi): {exc}")
    try:
        server = serve(node, cluster.listen, security, health_address=cluster.health_listen,
                       watch_condition=node.changed)
    except (SecurityError, OSError) as exc:
        if csi_server is not None:
            csi_server.stop()
        if plugins is not None:
            plugins.stop()
        node.stop()
        return _fail(str(exc))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    log.info("node %s: serving the operator on %s (port %d); %d GPU(s) known", cluster.node, cluster.listen,
             server.port, len(gpus))
    stop.wait()
    if csi_server is not None:
        csi_server.stop()  # its registration socket removed: the kubelet unregisters the plugin
    if plugins is not None:
        plugins.stop()
    server.stop()
    node.stop()
    return 0


def csi_mps_dirs(template: AgentConfig) -> MpsDirs | None:
    """The MPS directories every Pod's ``csi.bubbles.dev`` volume carries (at ``mps/pipe`` and ``mps/shm``) where the
    agent runs MPS: its pipe directory, found as the MPS isolation finds it, and its own /dev/shm (where the chart
    mounts ``agent.mps.shmDir``, the node directory the MPS server shares with its clients); None without MPS."""
    from bubbles.core.mps_client import DEFAULT_PIPE_DIR, PIPE_ENV, SHM_MOUNT

    from .csi.publish import MpsDirs

    iso = template.isolation
    if iso.mode is not IsolationMode.MPS:
        return None
    pipe_dir = iso.mps_pipe_dir or Path(os.environ.get(PIPE_ENV) or DEFAULT_PIPE_DIR)
    return MpsDirs(str(pipe_dir), SHM_MOUNT)


def gpu_resources(gpus: Iterable[NodeGpu]) -> dict[str, str]:
    """{GPU UUID: the extended resource the device plugin serves it as} (``nodeaccess.resource_name`` of its index):
    what the node agent reports as each GPU's ``gpu_resource``. A GPU NVML no longer answers for keeps its resource
    (the plugin keeps advertising it, its slots unhealthy)."""
    return {g.uuid: resource_name(g.index) for g in gpus}


def device_plugin_resources(plugins: DevicePlugins) -> Callable[[], dict[str, str]]:
    """``gpu_resources`` of the device plugin's GPUs as it knows them at each call (it looks at the node again)."""
    return lambda: gpu_resources(plugins.gpus)


def start_device_plugin(cluster: ClusterSettings, assigned: Callable[[], Sequence[FillPodGpus]]) -> DevicePlugins:
    """``--device-plugin``: the GPUs' resources served and registered with the kubelet, a container holding one let
    start only if its Pod is one of the fill Pods ``assigned`` on that GPU (the node agent's ``fill_pod_gpus``);
    OSError if a socket cannot be bound or the PodResources socket's directory is not mounted. GPUs given by
    ``--gpus`` are fixed and always healthy (nothing to ask); else NVML, asked again for health."""
    from . import podresources
    from .deviceplugin.shell import DevicePlugins, PluginConfig, PodResourcesGuard
    from .gpus import read_gpus

    dp = cluster.device_plugin
    assert dp is not None and dp.pod_resources_socket is not None
    if (problem := podresources.mount_problem(dp.pod_resources_socket)) is not None:
        raise OSError(problem)
    if not dp.pod_resources_socket.is_socket():
        logging.getLogger("bubbles.agent").warning(
            "device plugin: the kubelet's PodResources socket %s is not there yet: every container holding a GPU's "
            "slots is refused until it is", dp.pod_resources_socket)
    fixed = dict(cluster.gpus)
    plugins = DevicePlugins(PluginConfig(dp.strategy, dp.fill_slots, dp.directory),
                            (lambda: fixed) if fixed else read_gpus,
                            PodResourcesGuard(dp.pod_resources_socket, assigned))
    plugins.start()
    return plugins
