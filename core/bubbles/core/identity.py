"""One identity for a harvested GPU, the same in every part: ``GpuKey`` (namespace, training, stage, rank).

A training's stage runs on one GPU or on several (tensor- and data-parallel ranks); each of them has bubbles of its
own, is harvested on its own and is named by the key of its rank within its stage:

- ``namespace``: the training Pod's namespace (``$POD_NAMESPACE`` from the downward API), or ``_local`` where the
  training runs outside Kubernetes. ``_local`` is no Kubernetes namespace name (an underscore), so it never collides
  with one; two trainings of one name in two namespaces are two trainings.
- ``training``: the PipelineTraining's name (``$BUBBLES_TRAINING``).
- ``stage``: the pipeline stage, 0-based.
- ``rank``: the rank's index among its stage's ranks, 0-based, from DeepSpeed's process grid (``data-parallel rank x
  model-parallel ranks + model-parallel rank``). It is the same for a stage's rank across restarts and on every node.

The GPU itself (its UUID, its device) is what the rank runs on, carried beside the key (the card, the reports): a
training restarted onto other GPUs keeps its keys, and a fill job placed on a key reaches whichever GPU the rank has.
Why a rank rather than the UUID names the GPU here: it is known before anything is measured (a local agent binds its
sockets before the training starts), it is the same on CPU and on GPU, it survives a reschedule, and it keeps socket
paths within the 107 bytes a Unix socket allows (a UUID is 40 characters).

Standard library only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

LOCAL_NAMESPACE = "_local"  # a training outside Kubernetes (not a valid namespace name, so never a real one's)
MAX_STAGES = 4096
MAX_RANKS = 4096  # ranks of one stage: tensor x data parallel

_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$")
_NAMESPACE_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")  # a DNS label, as Kubernetes wants a namespace
_KEY_RE = re.compile(r"^([^/]+)/([^/]+)/stage-(\d+)/rank-(\d+)$")


def check_name(kind: str, name: str) -> str:
    """Validate a training or fill-job name used in paths (DNS-label style, like Kubernetes names)."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(
            f"{kind} name {name!r} is not valid: use 1-63 lower-case letters, digits, '.', '_' or '-', "
            "starting and ending with a letter or digit"
        )
    return name


def check_namespace(namespace: str) -> str:
    """A Kubernetes namespace name, or ``_local``; ValueError saying what is wrong."""
    if namespace == LOCAL_NAMESPACE or (isinstance(namespace, str) and _NAMESPACE_RE.match(namespace)):
        return namespace
    raise ValueError(f"namespace {namespace!r} is not valid: use a Kubernetes namespace name (1-63 lower-case "
                     f"letters, digits or '-', starting and ending with a letter or digit), or {LOCAL_NAMESPACE!r} "
                     "for a training outside Kubernetes")


def _index(kind: str, value: object, limit: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < limit:
        raise ValueError(f"{kind} {value!r} is not valid: use an integer from 0 to {limit - 1}")
    return value


@dataclass(frozen=True, order=True)
class GpuKey:
    """One rank of one stage of one training: the unit bubbles harvests (see the module documentation)."""

    namespace: str
    training: str
    stage: int
    rank: int = 0

    def __post_init__(self) -> None:
        check_namespace(self.namespace)
        check_name("training", self.training)
        _index("stage", self.stage, MAX_STAGES)
        _index("rank", self.rank, MAX_RANKS)

    def __str__(self) -> str:
        return f"{self.namespace}/{self.training}/stage-{self.stage}/rank-{self.rank}"

    @property
    def local(self) -> bool:
        return self.namespace == LOCAL_NAMESPACE

    @property
    def stage_key(self) -> tuple[str, str, int]:
        """(namespace, training, stage): what a stage's GPUs share (one slowdown guard, one schedule)."""
        return (self.namespace, self.training, self.stage)

    @property
    def training_key(self) -> tuple[str, str]:
        """(namespace, training): a training, namespace-qualified."""
        return (self.namespace, self.training)

    @classmethod
    def parse(cls, text: str) -> GpuKey:
        """The key ``str(key)`` wrote; ValueError saying the form otherwise."""
        m = _KEY_RE.match(text) if isinstance(text, str) else None
        if m is None:
            raise ValueError(f"{text!r} is not a GPU key: write <namespace>/<training>/stage-<k>/rank-<r>")
        return cls(m.group(1), m.group(2), int(m.group(3)), int(m.group(4)))


def stage_rank(data_parallel_rank: int, model_parallel_rank: int, model_parallel_size: int) -> int:
    """A rank's index among its stage's ranks, from its place in DeepSpeed's pipe x data x model grid."""
    if model_parallel_size < 1 or not 0 <= model_parallel_rank < model_parallel_size or data_parallel_rank < 0:
        raise ValueError(f"model-parallel rank {model_parallel_rank} of {model_parallel_size}, data-parallel rank "
                         f"{data_parallel_rank}: not a place in a grid")
    return data_parallel_rank * model_parallel_size + model_parallel_rank
