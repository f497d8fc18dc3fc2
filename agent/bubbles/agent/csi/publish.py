"""What a NodePublishVolume or NodeUnpublishVolume of ``csi.bubbles.dev`` means: pure decisions over plain data.

The kubelet publishes an inline ephemeral volume (a Pod's ``volumes: [{csi: {driver: csi.bubbles.dev,
volumeAttributes: {role: training}}}]``) when the Pod starts on the node and unpublishes it when the Pod is torn down.
With the CSIDriver object's ``podInfoOnMount: true`` it names the Pod in ``volume_context``; that, not anything the
Pod says of itself, is how the agent knows whose directory it is. Each Pod gets ``<run_dir>/_pods/<pod uid>/``,
bind-mounted at the volume's target (the shell, ``bubbles.agent.csi.plugin``, does the mkdir and the mount).

Where the agent runs MPS (``--isolation mps``), the Pod's directory also carries the node's MPS server: ``plan_publish``
adds the agent's MPS pipe and shared-memory directories as bind mounts at ``mps/pipe`` and ``mps/shm`` in it
(``nodeaccess.POD_MPS_PIPE_SUBDIR``, ``POD_MPS_SHM_SUBDIR``; ``SubMount``), for a training's volume and a fill Pod's
alike: a Pod sets ``CUDA_MPS_PIPE_DIRECTORY=/run/bubbles/mps/pipe`` and mounts the same volume at /dev/shm with
``subPath: mps/shm``.

Nothing here touches the file system, a socket or a clock: ``plan_publish`` and ``plan_unpublish`` take the book of
published volumes and a request and say what to do, or raise ``Refused`` with the gRPC status to answer (by name, so
this module imports no gRPC) and a message that says what to change in the Pod spec or the CSIDriver.
"""

from __future__ import annotations

import enum
import json
import posixpath
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from bubbles.core import paths
from bubbles.core.identity import check_namespace
from bubbles.core.nodeaccess import CSI_DRIVER, POD_MPS_PIPE_SUBDIR, POD_MPS_SHM_SUBDIR, ROLE_KEY, Role
from bubbles.core.paths import is_plain_absolute

DRIVER_NAME = CSI_DRIVER

# What the kubelet adds to volume_context when the CSIDriver object says podInfoOnMount: true (kubelet 1.20 and later;
# "ephemeral" since 1.16, "true" for an inline volume in a Pod's spec, "false" for a PersistentVolume).
POD_NAME_KEY = "csi.storage.k8s.io/pod.name"
POD_NAMESPACE_KEY = "csi.storage.k8s.io/pod.namespace"
POD_UID_KEY = "csi.storage.k8s.io/pod.uid"
SERVICE_ACCOUNT_KEY = "csi.storage.k8s.io/serviceAccount.name"
EPHEMERAL_KEY = "csi.storage.k8s.io/ephemeral"
KUBELET_KEY_PREFIX = "csi.storage.k8s.io/"  # the kubelet's own keys: whatever newer kubelets add is let through

# <run_dir>/_pods/<pod uid>/ per published Pod, and the book of published volumes beside them (a uid has no '.').
PODS_DIR_NAME = paths.PODS_DIR_NAME  # an underscore: no namespace can be named so (the node has one per namespace)
STATE_FILE_NAME = "csi-volumes.json"
STATE_VERSION = 1

POD_INFO_HINT = f"set podInfoOnMount: true in the CSIDriver {DRIVER_NAME} (the chart does)"

# A Pod's name is a DNS subdomain; its uid a UUID (an API Pod's) or a hash in hex (a static Pod's): either way a
# single path component, which is what matters here.
_POD_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$")
_POD_UID_RE = re.compile(r"^[0-9a-f]([0-9a-f-]{0,62}[0-9a-f])?$")
_SERVICE_ACCOUNT_RE = _POD_NAME_RE


class Status(enum.Enum):
    """The gRPC status of a refusal, by the name ``grpc.StatusCode`` gives it (the shell maps it)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    ALREADY_EXISTS = "ALREADY_EXISTS"


class Refused(Exception):
    """A request this plugin will not carry out; ``str()`` says what to change."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status


def _invalid(message: str) -> Refused:
    return Refused(Status.INVALID_ARGUMENT, message)


@dataclass(frozen=True)
class PublishRequest:
    """The parts of a NodePublishVolumeRequest that matter here (``access``: "mount", "block" or "" when the
    request carries no volume_capability)."""

    volume_id: str
    target_path: str
    volume_context: Mapping[str, str]
    access: str = "mount"
    readonly: bool = False


@dataclass(frozen=True)
class PodVolume:
    """A published volume: whose Pod it serves, in which role, and the node directory bind-mounted at its target."""

    volume_id: str
    target_path: str
    namespace: str
    pod: str
    uid: str
    role: Role
    service_account: str
    directory: str  # <run_dir>/_pods/<uid>

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "role": self.role.value}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PodVolume:
        return cls(volume_id=str(data["volume_id"]), target_path=str(data["target_path"]),
                   namespace=str(data["namespace"]), pod=str(data["pod"]), uid=str(data["uid"]),
                   role=Role(data["role"]), service_account=str(data.get("service_account", "")),
                   directory=str(data["directory"]))


@dataclass(frozen=True)
class MpsDirs:
    """The node's MPS server as the agent sees it: the pipe directory (``--mps-pipe-dir``: the control daemon's
    socket, the servers' pipes) and the shared-memory directory (the agent's /dev/shm, where the chart mounts
    ``agent.mps.shmDir``). Check them with ``mps_dirs_problem``."""

    pipe_dir: str
    shm_dir: str


@dataclass(frozen=True)
class SubMount:
    """A directory of the agent's bind-mounted inside a Pod's directory: ``source`` at ``<pod dir>/<subdir>``."""

    source: str
    subdir: str  # relative, '/'-separated, no '.' or '..' parts


def mps_submounts(mps: MpsDirs | None) -> tuple[SubMount, ...]:
    """What each Pod's directory carries of the node's MPS server: nothing without MPS (None)."""
    if mps is None:
        return ()
    return (SubMount(mps.pipe_dir, POD_MPS_PIPE_SUBDIR), SubMount(mps.shm_dir, POD_MPS_SHM_SUBDIR))


def _contains(outer: str, inner: str) -> bool:
    """Whether plain absolute path ``inner`` is ``outer`` or below it."""
    return inner == outer or inner.startswith(outer.rstrip("/") + "/")


def mps_dirs_problem(mps: MpsDirs, run_dir: str) -> str | None:
    """Why ``mps`` cannot be bind-mounted into Pods' directories under ``run_dir``, with what to do; None: it can.
    Each must be a plain absolute path of its own, neither inside ``<run_dir>/_pods/`` (a Pod's directory inside
    another's) nor above it (every Pod would see every other Pod's directory)."""
    pods = posixpath.join(run_dir, PODS_DIR_NAME)
    for flag, path in (("--mps-pipe-dir", mps.pipe_dir), ("the MPS shared-memory directory", mps.shm_dir)):
        if not is_plain_absolute(path):
            return (f"{flag} {path!r} must be an absolute path written without '.' or '..' parts or repeated or "
                    "trailing slashes: give it so")
        if _contains(path, pods) or _contains(pods, path):
            return (f"{flag} {path} and the Pods' directories {pods} must not contain one another (each Pod's "
                    f"directory carries {path}): give a directory outside --run-dir")
    if _contains(mps.pipe_dir, mps.shm_dir) or _contains(mps.shm_dir, mps.pipe_dir):
        return (f"--mps-pipe-dir {mps.pipe_dir} and the MPS shared-memory directory {mps.shm_dir} must not contain "
                "one another (each is mounted in the Pods on its own): give the pipe directory a place of its own")
    return None


@dataclass(frozen=True)
class Publish:
    """What a publish asks for: mount ``volume.directory`` at ``volume.target_path``, carrying ``submounts`` (bind
    mounts inside the directory, made first; the directory's mount at the target is then recursive, so that the
    target carries them); ``already``: the same volume is in the book at the same target (a retry: answer OK once the
    mounts are there)."""

    volume: PodVolume
    already: bool
    submounts: tuple[SubMount, ...] = ()


@dataclass(frozen=True)
class Unpublish:
    """What an unpublish asks for: forget ``volume`` (None: not in the book), undo the mount at ``target`` and remove
    that directory (None: a target outside the kubelet's Pods, or another volume's: left alone), and remove
    ``pod_dir`` once no volume of its Pod is left (None: keep it)."""

    volume: PodVolume | None
    target: str | None
    pod_dir: str | None


def pod_dir(run_dir: str, uid: str) -> str:
    """The node directory of one Pod's volumes."""
    return posixpath.join(run_dir, PODS_DIR_NAME, uid)


def _kubelet_key(context: Mapping[str, str], key: str) -> str:
    value = context.get(key)
    if not value:
        raise Refused(Status.FAILED_PRECONDITION,
                      f"the kubelet did not say which Pod the volume is for (no {key} in volume_context): "
                      f"{POD_INFO_HINT}")
    return value


def read_pod(context: Mapping[str, str]) -> tuple[str, str, str, str, Role]:
    """(namespace, name, uid, service account, role) from a publish's ``volume_context``; ``Refused`` saying what to
    set when the CSIDriver or the Pod's volume is not as this plugin needs it."""
    namespace = _kubelet_key(context, POD_NAMESPACE_KEY)
    name = _kubelet_key(context, POD_NAME_KEY)
    uid = _kubelet_key(context, POD_UID_KEY)
    ephemeral = _kubelet_key(context, EPHEMERAL_KEY)
    if ephemeral != "true":
        raise _invalid(f"{DRIVER_NAME} serves only inline ephemeral volumes ({EPHEMERAL_KEY} is {ephemeral!r}): "
                       f"declare it in the Pod's spec.volumes as csi: {{driver: {DRIVER_NAME}, volumeAttributes: "
                       "{role: training}}, not through a PersistentVolume, and keep volumeLifecycleModes: [Ephemeral] "
                       "in the CSIDriver")
    try:
        check_namespace(namespace)
    except ValueError:
        raise _invalid(f"volume_context {POD_NAMESPACE_KEY} {namespace!r} is not a Kubernetes namespace name") from None
    if not _POD_NAME_RE.match(name):
        raise _invalid(f"volume_context {POD_NAME_KEY} {name!r} is not a Kubernetes Pod name")
    if not _POD_UID_RE.match(uid):
        raise _invalid(f"volume_context {POD_UID_KEY} {uid!r} is not a Pod uid (lower-case hex digits and '-')")
    account = context.get(SERVICE_ACCOUNT_KEY, "")
    if account and not _SERVICE_ACCOUNT_RE.match(account):
        raise _invalid(f"volume_context {SERVICE_ACCOUNT_KEY} {account!r} is not a service account name")
    unknown = sorted(k for k in context if k != ROLE_KEY and not k.startswith(KUBELET_KEY_PREFIX))
    if unknown:
        raise _invalid(f"volumeAttributes {', '.join(unknown)} not known to {DRIVER_NAME}: its only attribute is "
                       f"{ROLE_KEY} (training or fill); remove the others from the Pod's csi volume")
    role = context.get(ROLE_KEY)
    if not role:
        raise _invalid(f"volumeAttributes.{ROLE_KEY} is missing: set volumeAttributes: {{{ROLE_KEY}: training}} in "
                       f"the training Pod's csi volume ({ROLE_KEY}: fill is the operator's, in fill Pods)")
    try:
        return namespace, name, uid, account, Role(role)
    except ValueError:
        raise _invalid(f"volumeAttributes.{ROLE_KEY} must be training or fill, got {role!r}") from None


def pod_of_target(target_path: str, kubelet_pods_dir: str) -> str | None:
    """The Pod uid whose kubelet directory holds ``target_path`` (``<kubelet_pods_dir>/<uid>/...``), or None when the
    path is not plainly below it."""
    if not is_plain_absolute(target_path):
        return None
    prefix = kubelet_pods_dir.rstrip("/") + "/"
    if not target_path.startswith(prefix):
        return None
    uid, sep, rest = target_path[len(prefix):].partition("/")
    return uid if sep and rest and _POD_UID_RE.match(uid) else None


def plan_publish(book: Mapping[str, PodVolume], request: PublishRequest, *, run_dir: str,
                 kubelet_pods_dir: str, mps: MpsDirs | None = None) -> Publish:
    """What NodePublishVolume ``request`` means given the volumes already published (``book``, by volume id); where
    the agent runs MPS (``mps``), the Pod's directory carries its directories (``mps_submounts``) whatever the role.

    Idempotent as CSI wants: the same volume at the same target is ``already`` published (OK again); the same volume
    id at another target, another volume at this target, or the same one for another Pod is ALREADY_EXISTS. Refused
    with INVALID_ARGUMENT or FAILED_PRECONDITION, naming the field and what to set, when the request is not a Pod's
    inline volume as the kubelet sends it."""
    if not request.volume_id:
        raise _invalid("NodePublishVolume needs a volume_id (the kubelet sends one for every volume)")
    if not request.target_path:
        raise _invalid("NodePublishVolume needs a target_path (the kubelet sends one for every volume)")
    if request.access != "mount":
        raise _invalid(f"{DRIVER_NAME} publishes a directory: the request must ask for a mount volume_capability "
                       f"(a Pod's inline csi volume does), got {request.access or 'none'}")
    if request.readonly:
        raise _invalid(f"the {DRIVER_NAME} volume is readOnly, but its Pod writes there (the hook its cards, fill jobs "
                       "their sockets): set readOnly: false in the Pod's csi volume, or leave it out")
    namespace, name, uid, account, role = read_pod(request.volume_context)
    owner = pod_of_target(request.target_path, kubelet_pods_dir)
    if owner != uid:
        raise _invalid(f"target_path {request.target_path} is not in the kubelet's directory of Pod {uid} "
                       f"({kubelet_pods_dir.rstrip('/')}/{uid}/): if the kubelet runs with another --root-dir, give "
                       "the agent --kubelet-dir with that directory")
    volume = PodVolume(request.volume_id, request.target_path, namespace, name, uid, role, account,
                       pod_dir(run_dir, uid))
    known = book.get(request.volume_id)
    if known is not None:
        if known == volume:
            return Publish(volume, already=True, submounts=mps_submounts(mps))
        if known.target_path != volume.target_path:
            raise Refused(Status.ALREADY_EXISTS, f"volume {volume.volume_id} is already published at "
                          f"{known.target_path}; {DRIVER_NAME} publishes a volume at one target only")
        raise Refused(Status.ALREADY_EXISTS, f"volume {volume.volume_id} is already published at "
                      f"{known.target_path} for Pod {known.namespace}/{known.pod} ({known.uid}, role {known.role}); "
                      "unpublish it first")
    for other in book.values():
        if other.target_path == volume.target_path:
            raise Refused(Status.ALREADY_EXISTS, f"{volume.target_path} already holds volume {other.volume_id}; "
                          "unpublish it first")
        if other.uid == uid and other.role != role:
            raise _invalid(f"Pod {namespace}/{name} already has a {DRIVER_NAME} volume with {ROLE_KEY} {other.role}; "
                           f"a Pod is a training's or a fill Pod, not both: give its {DRIVER_NAME} volumes one "
                           f"{ROLE_KEY}")
    return Publish(volume, already=False, submounts=mps_submounts(mps))


def plan_unpublish(book: Mapping[str, PodVolume], volume_id: str, target_path: str, *,
                   kubelet_pods_dir: str) -> Unpublish:
    """What NodeUnpublishVolume means: OK whatever the book says (CSI: a volume not published at the target is OK);
    a target in the kubelet's Pods that no other volume holds is cleaned even when the book does not know it (the
    agent lost its state), and the Pod's directory goes with its last volume."""
    if not volume_id:
        raise _invalid("NodeUnpublishVolume needs a volume_id (the kubelet sends one for every volume)")
    if not target_path:
        raise _invalid("NodeUnpublishVolume needs a target_path (the kubelet sends one for every volume)")
    volume = book.get(volume_id)
    if volume is not None and volume.target_path != target_path:
        volume = None  # published elsewhere: this call is not about it
    if volume is not None:
        target: str | None = target_path  # checked when it was published
    else:
        held = any(v.target_path == target_path for v in book.values())
        target = target_path if not held and pod_of_target(target_path, kubelet_pods_dir) is not None else None
    last = volume is not None and not any(v.uid == volume.uid for k, v in book.items() if k != volume_id)
    return Unpublish(volume, target, volume.directory if volume is not None and last else None)


def book_to_json(book: Mapping[str, PodVolume]) -> str:
    """The state file's text: the book, so that an agent restarted knows what it published."""
    return json.dumps({"version": STATE_VERSION, "volumes": [book[k].to_json() for k in sorted(book)]}, indent=1)


def book_from_json(text: str) -> dict[str, PodVolume]:
    """The book from a state file's text; ValueError saying what is wrong."""
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
            raise ValueError(f"not a version {STATE_VERSION} state file")
        volumes = [PodVolume.from_json(v) for v in data["volumes"]]
    except (KeyError, TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"unreadable: {exc}") from None
    return {v.volume_id: v for v in volumes}
