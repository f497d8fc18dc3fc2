"""Fill-job traces: our CSV format, the Alibaba GPU trace (2023) it is generated from, and the generator.

Our trace CSV has a header row and one job per row:
    job_id (optional), arrival_s, model, kind (training | batch-inference),
    samples, or steps together with batch_size, deadline_s (optional; empty for none)

The generator follows PipeFill section 5.3: from the Alibaba trace (Weng et al., ATC '23) drop the
latency-sensitive tasks, turn GPUs x service time into GPU-hours, keep jobs up to 1 GPU-hour, and
sample arrivals (the gaps between consecutive tasks) and sizes from what is left; each job's size
bucket maps it to a model of PipeFill's Table 1 (smaller jobs to smaller models, buckets as wide as
the models' sampling probabilities), models under 700M parameters train or run batch inference
with equal probability, larger ones always run batch inference, and samples = GPU-hours x the
model's best isolated throughput on one GPU.

The generator works on columns (numpy arrays), not on an object per task or job: the packaged trace model's tasks
come as ``TaskColumns`` and a generated trace as a ``TraceTable``, whose ``fill_jobs`` are what the simulator runs
and whose ``rows`` are the ``TraceJob`` rows that ``generate_trace`` returns and ``write_trace`` writes. The random
streams, and so every generated job, are those of the loop over jobs the generator was before (2026-12;
tests/test_simulator_equivalence.py holds it to that loop).
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bubbles.core.api import WorkloadKind
from bubbles.operator.scheduler.core import FillJobRequest, FillProfile
from bubbles.operator.simulator.gcpause import gc_paused

ALIBABA_COLUMNS = ("name", "num_gpu", "qos", "creation_time", "deletion_time", "scheduled_time")
TRACE_COLUMNS = ("arrival_s", "model", "kind")

# PipeFill Table 1 with our sampling probabilities. The paper matches them to the HuggingFace Model
# Hub (10.4% CNNs, the rest transformers) without printing them; the split among the transformers
# is our assumption. Ordered by parameter count, which is the order of the size buckets.
MODEL_MIX: tuple[tuple[str, int, float], ...] = (
    ("bert-base", 109_000_000, 0.40),
    ("efficientnet", 117_000_000, 0.104),
    ("bert-large", 334_000_000, 0.25),
    ("swin-large", 779_000_000, 0.146),
    ("xlm-roberta-xl", 2_800_000_000, 0.10),
)
TRAINING_MAX_PARAMS = 700_000_000


TRACE_MODEL_PATH = Path(__file__).resolve().parent / "data" / "alibaba2023_trace_model.json"


class TraceError(ValueError):
    """A trace file that cannot be used; the message names the file, the line and what to fix."""


@dataclass(frozen=True)
class AlibabaTask:
    name: str
    arrival_s: float
    gpu_hours: float


@dataclass(frozen=True, eq=False)
class TaskColumns:
    """Trace tasks as columns: arrival times and sizes (GPU-hours), row k one task."""

    arrival_s: np.ndarray
    gpu_hours: np.ndarray

    def __post_init__(self) -> None:
        if self.arrival_s.shape != self.gpu_hours.shape or self.arrival_s.ndim != 1:
            raise ValueError(f"a task's arrival and size go together: got {self.arrival_s.shape} arrival times and "
                             f"{self.gpu_hours.shape} sizes; pass two 1-d arrays of one length")

    def __len__(self) -> int:
        return len(self.arrival_s)

    @classmethod
    def of(cls, tasks: Sequence[AlibabaTask] | TaskColumns) -> TaskColumns:
        """``tasks`` as columns (columns as they are)."""
        if isinstance(tasks, TaskColumns):
            return tasks
        return cls(np.array([t.arrival_s for t in tasks], dtype=float), np.array([t.gpu_hours for t in tasks],
                                                                                  dtype=float))


@dataclass(frozen=True)
class FilterStats:
    """What PipeFill's filtering leaves of the trace (section 5.3)."""

    rows: int
    candidates: int  # GPU tasks, not latency-sensitive, ever scheduled
    kept: int  # candidates under the cap
    cap_gpu_hours: float
    median_gpu_hours: float

    @property
    def share_kept(self) -> float:
        return self.kept / self.candidates if self.candidates else 0.0


@dataclass(frozen=True)
class TraceJob:
    """One row of a fill-job trace (its ``kind`` column is the WorkloadKind's label)."""

    job_id: str
    arrival_s: float
    model: str
    kind: WorkloadKind
    samples: int
    deadline_s: float | None = None

    def to_fill_job(self, profiles: Mapping[tuple[str, WorkloadKind], FillProfile],
                    setup_s: float = 0.0) -> FillJobRequest:
        return FillJobRequest(
            self.job_id, profiles[(self.model, self.kind)], self.samples, self.arrival_s, self.deadline_s,
            setup_s=setup_s,
        )


def with_gangs(jobs: Sequence[FillJobRequest], share: float, gpus: int, seed: int = 0) -> list[FillJobRequest]:
    """``jobs`` with a random ``share`` of them (drawn with ``seed``, the same jobs every run) asking for ``gpus``
    executors at once: gang jobs, whose work is split among their processes. A share of 0 changes nothing."""
    if not 0 <= share <= 1:
        raise ValueError(f"the share of gang jobs must be in [0, 1], got {share}")
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"a gang's GPUs must be a whole number >= 1, got {gpus!r}")
    if share == 0 or gpus == 1:
        return list(jobs)
    draw = np.random.default_rng(seed).random(len(jobs))
    return [dataclasses.replace(j, gpus=gpus) if d < share else j for j, d in zip(jobs, draw, strict=True)]


def read_alibaba(path: str | Path, cap_gpu_hours: float = 1.0) -> tuple[list[AlibabaTask], FilterStats]:
    """Read ``openb_pod_list_*.csv`` (the trace's own format) and apply PipeFill's filter.

    Keeps GPU tasks whose qos is not LS and that were scheduled, with GPU-hours = num_gpu x
    (deletion_time - scheduled_time) / 3600 up to ``cap_gpu_hours``. Raises TraceError on a file
    that is not in that format.
    """
    p = Path(path)
    rows = 0
    candidates: list[AlibabaTask] = []
    try:
        with p.open(newline="") as f:
            reader = csv.DictReader(f)
            missing = [c for c in ALIBABA_COLUMNS if c not in (reader.fieldnames or [])]
            if missing:
                raise TraceError(
                    f"{p}: not an Alibaba GPU trace pod list (missing columns {', '.join(missing)}); "
                    "pass cluster-trace-gpu-v2023/csv/openb_pod_list_*.csv"
                )
            for line, r in enumerate(reader, start=2):
                rows += 1
                try:
                    gpus = int(r["num_gpu"])
                    if r["qos"] == "LS" or gpus < 1 or not r["scheduled_time"]:
                        continue
                    service_s = float(r["deletion_time"]) - float(r["scheduled_time"])
                    arrival = float(r["creation_time"])
                except (TypeError, ValueError):
                    raise TraceError(
                        f"{p} line {line}: num_gpu, creation_time, scheduled_time and deletion_time must be "
                        f"numbers, got {dict(r)}; fix or drop the row"
                    ) from None
                if service_s < 0:
                    raise TraceError(
                        f"{p} line {line}: deletion_time precedes scheduled_time; fix or drop the row"
                    )
                candidates.append(AlibabaTask(r["name"], arrival, gpus * service_s / 3600))
    except OSError as e:
        raise TraceError(f"cannot read {p}: {e.strerror}; pass the path of the trace CSV") from None
    kept = [t for t in candidates if t.gpu_hours <= cap_gpu_hours]
    sizes = sorted(t.gpu_hours for t in candidates)
    stats = FilterStats(
        rows=rows,
        candidates=len(candidates),
        kept=len(kept),
        cap_gpu_hours=cap_gpu_hours,
        median_gpu_hours=float(np.median(sizes)) if sizes else 0.0,
    )
    return kept, stats


@dataclass(frozen=True)
class TraceModel:
    """The packaged stand-in for the Alibaba trace: quantiles of the kept tasks' inter-arrival gaps and sizes.

    Fitted by ``tools/fit-trace-model.py``; ``source`` says to what. Gaps and sizes are sampled independently (the real
    trace pairs them per task), by inverse transform with linear interpolation between the quantiles.
    """

    gap_s_quantiles: tuple[float, ...]
    gpu_hours_quantiles: tuple[float, ...]
    source: Mapping[str, object]

    def tasks(self, n: int, seed: int = 0) -> list[AlibabaTask]:
        """``n`` synthetic tasks, as ``read_alibaba`` returns kept tasks (``columns``' tasks, one object each)."""
        cols = self.columns(n, seed)
        return [AlibabaTask(f"model-{i:05d}", a, h)
                for i, (a, h) in enumerate(zip(cols.arrival_s.tolist(), cols.gpu_hours.tolist(), strict=True))]

    def columns(self, n: int, seed: int = 0) -> TaskColumns:
        """``n`` synthetic tasks as columns (what ``generate_trace`` needs of them)."""
        if n < 2:
            raise ValueError(f"n must be >= 2, got {n}")
        rng = np.random.default_rng(seed)
        grid = np.linspace(0, 1, len(self.gap_s_quantiles))
        gaps = np.interp(rng.random(n), grid, self.gap_s_quantiles)
        grid = np.linspace(0, 1, len(self.gpu_hours_quantiles))
        sizes = np.interp(rng.random(n), grid, self.gpu_hours_quantiles)
        return TaskColumns(np.cumsum(gaps), sizes)

    def describe(self) -> str:
        s = self.source
        return (f"a model of the Alibaba GPU trace 2023 packaged with bubbles (quantiles of {s.get('kept')} tasks' "
                f"arrival gaps and sizes, {s.get('share_kept', 0):.1%} of its {s.get('candidates')} "
                "non-latency-sensitive GPU tasks, up to 1 GPU-hour)")


def load_trace_model(path: str | Path = TRACE_MODEL_PATH) -> TraceModel:
    """Read a trace model file; TraceError saying what is wrong."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
        gaps = tuple(float(v) for v in doc["gap_s_quantiles"])
        sizes = tuple(float(v) for v in doc["gpu_hours_quantiles"])
        source = dict(doc.get("source") or {})
    except OSError as e:
        raise TraceError(f"cannot read the trace model {p}: {e.strerror}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise TraceError(f"{p} is not a trace model ({e!r}); regenerate it with tools/fit-trace-model.py") from None
    for name, q in (("gap_s_quantiles", gaps), ("gpu_hours_quantiles", sizes)):
        if len(q) < 2 or any(b < a for a, b in itertools.pairwise(q)) or q[0] < 0:
            raise TraceError(f"{p}: {name} must be at least 2 non-negative, non-decreasing values; "
                             "regenerate it with tools/fit-trace-model.py")
    return TraceModel(gaps, sizes, source)


@dataclass(frozen=True, eq=False)
class TraceTable:
    """A fill-job trace as columns (what the generator makes), row k one job: ``rows`` gives its ``TraceJob`` rows,
    ``fill_jobs`` the simulator's jobs without a row object in between."""

    job_ids: Sequence[str]
    arrival_s: np.ndarray
    keys: tuple[tuple[str, WorkloadKind], ...]  # the (model, kind) of each profile the trace uses
    key: np.ndarray  # per job: its (model, kind), an index into ``keys``
    samples: np.ndarray  # whole numbers >= 1
    deadline_s: np.ndarray  # NaN where a job has none

    def __len__(self) -> int:
        return len(self.job_ids)

    def rows(self) -> list[TraceJob]:
        keys = self.keys
        with gc_paused():
            return [TraceJob(i, a, keys[k][0], keys[k][1], n, None if math.isnan(d) else d)
                    for i, a, k, n, d in zip(self.job_ids, self.arrival_s.tolist(), self.key.tolist(),
                                             self.samples.tolist(), self.deadline_s.tolist(), strict=True)]

    def fill_jobs(self, profiles: Mapping[tuple[str, WorkloadKind], FillProfile],
                  setup_s: float = 0.0) -> list[FillJobRequest]:
        """Every row's ``TraceJob.to_fill_job(profiles, setup_s)``, without the rows."""
        used = [profiles[k] for k in self.keys]
        with gc_paused():
            return [FillJobRequest(i, used[k], n, a, None if math.isnan(d) else d, setup_s=setup_s)
                    for i, k, n, a, d in zip(self.job_ids, self.key.tolist(), self.samples.tolist(),
                                             self.arrival_s.tolist(), self.deadline_s.tolist(), strict=True)]


def generate_trace(
    tasks: Sequence[AlibabaTask] | TaskColumns,
    profiles: Mapping[tuple[str, WorkloadKind], FillProfile],
    *,
    jobs: int,
    hours: float,
    seed: int = 0,
    deadline_share: float = 0.0,
    deadline_slack: float = 10.0,
    setup_s: float = 0.0,
    mix: Sequence[tuple[str, int, float]] = MODEL_MIX,
) -> list[TraceJob]:
    """``jobs`` fill jobs arriving over ``hours``, sampled from the filtered trace ``tasks``: ``generate_table``'s
    rows."""
    return generate_table(tasks, profiles, jobs=jobs, hours=hours, seed=seed, deadline_share=deadline_share,
                          deadline_slack=deadline_slack, setup_s=setup_s, mix=mix).rows()


def generate_table(
    tasks: Sequence[AlibabaTask] | TaskColumns,
    profiles: Mapping[tuple[str, WorkloadKind], FillProfile],
    *,
    jobs: int,
    hours: float,
    seed: int = 0,
    deadline_share: float = 0.0,
    deadline_slack: float = 10.0,
    setup_s: float = 0.0,
    mix: Sequence[tuple[str, int, float]] = MODEL_MIX,
) -> TraceTable:
    """``jobs`` fill jobs arriving over ``hours``, sampled from the filtered trace ``tasks``, as columns.

    Arrival gaps and sizes are sampled together (one trace task per job) and the gaps are scaled so
    the jobs span ``hours``. A ``deadline_share`` of jobs get a deadline ``deadline_slack`` times their
    isolated run time after arrival, plus ``setup_s``: each job's start-up (the simulator's --init-s), which no
    policy can shorten, so a deadline is no tighter for a job that must first load its model.
    """
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    if not hours > 0:
        raise ValueError(f"hours must be > 0, got {hours}")
    if not setup_s >= 0:
        raise ValueError(f"setup_s must be >= 0, got {setup_s}")
    cols = TaskColumns.of(tasks)
    usable = cols.gpu_hours > 0
    by_arrival = np.argsort(cols.arrival_s[usable], kind="stable")  # ties in the tasks' order, as sorted() keeps them
    arrivals = cols.arrival_s[usable][by_arrival]
    sizes = cols.gpu_hours[usable][by_arrival]
    if len(sizes) < 2:
        raise ValueError(
            "the filtered trace has fewer than 2 usable tasks; pass a larger excerpt of the trace"
        )
    missing = [f"{m}/{WorkloadKind.BATCH_INFERENCE.label}" for m, _, _ in mix
               if (m, WorkloadKind.BATCH_INFERENCE) not in profiles]
    if missing:
        raise ValueError(f"no profile for {', '.join(missing)}; add them to the model profiles file")
    rng = np.random.default_rng(seed)
    gaps = np.diff(arrivals, prepend=arrivals[0])
    gaps[0] = float(np.median(gaps[1:]))
    # Rank of each task's size (ties broken by order) -> which model's bucket it falls in.
    order = np.argsort(sizes, kind="stable")
    quantile = np.empty(len(sizes))
    quantile[order] = (np.arange(len(sizes)) + 0.5) / len(sizes)
    probs = np.array([w for _, _, w in mix], dtype=float)
    edges = np.cumsum(probs / probs.sum())
    bucket = np.minimum(np.searchsorted(edges, quantile), len(mix) - 1)

    pick = rng.integers(0, len(sizes), size=jobs)
    g = gaps[pick]
    total = float(g.sum()) or 1.0
    arrival_s = np.cumsum(g) * (hours * 3600.0 / total) - g[0] * (hours * 3600.0 / total)
    coin = rng.random(jobs)
    dl = rng.random(jobs)
    # Each job's profile: its bucket's model, training (if the model is small enough and the coin says so) where a
    # training profile exists, else batch inference; the job's kind is its profile's.
    wanted = [(model, kind) for model, params, _ in mix
              for kind in (WorkloadKind.BATCH_INFERENCE,
                           WorkloadKind.TRAINING if params < TRAINING_MAX_PARAMS else WorkloadKind.BATCH_INFERENCE)]
    chosen = [profiles.get(k) or profiles[(k[0], WorkloadKind.BATCH_INFERENCE)] for k in wanted]
    model_of = bucket[pick]
    key = 2 * model_of + (coin < 0.5)
    work_s = sizes[pick] * 3600.0
    rate = np.array([p.isolated_samples_per_s for p in chosen], dtype=float)[key]
    samples = np.maximum(1.0, np.rint(work_s * rate))  # round(): to the nearest, halves to even
    deadline_s = np.where(dl < deadline_share, arrival_s + deadline_slack * work_s + setup_s, math.nan)
    return TraceTable(
        job_ids=[f"job-{n:06d}" for n in range(jobs)],
        arrival_s=arrival_s,
        keys=tuple((model, p.kind) for (model, _), p in zip(wanted, chosen, strict=True)),
        key=key,
        samples=samples.astype(np.int64),
        deadline_s=deadline_s,
    )


def write_trace(path: str | Path, jobs: Iterable[TraceJob]) -> None:
    with Path(path).open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["job_id", "arrival_s", "model", "kind", "samples", "deadline_s"])
        for j in jobs:
            w.writerow(
                [
                    j.job_id,
                    f"{j.arrival_s:.3f}",
                    j.model,
                    j.kind.label,
                    j.samples,
                    "" if j.deadline_s is None else f"{j.deadline_s:.3f}",
                ]
            )


def read_trace(path: str | Path, profiles: Mapping[tuple[str, WorkloadKind], FillProfile]) -> list[TraceJob]:
    """Read our fill-job trace CSV; raise TraceError naming the line and what to fix."""
    p = Path(path)
    out: list[TraceJob] = []
    known = sorted({f"{m}/{k.label}" for m, k in profiles})
    try:
        with p.open(newline="") as f:
            reader = csv.DictReader(f)
            cols = reader.fieldnames or []
            missing = [c for c in TRACE_COLUMNS if c not in cols]
            if missing or not ("samples" in cols or {"steps", "batch_size"} <= set(cols)):
                raise TraceError(
                    f"{p}: a fill-job trace needs the columns arrival_s, model, kind and samples (or steps "
                    f"and batch_size), optionally job_id and deadline_s; the header has "
                    f"{', '.join(cols) or 'nothing'}"
                    + (". For the Alibaba trace itself use --alibaba" if "qos" in cols else "")
                )
            seen: set[str] = set()
            for line, r in enumerate(reader, start=2):
                out.append(_row(p, line, r, profiles, known, seen))
    except OSError as e:
        raise TraceError(f"cannot read trace {p}: {e.strerror}; pass an existing CSV file") from None
    if not out:
        raise TraceError(f"{p}: the trace has no jobs; add at least one row")
    return out


def _row(
    p: Path,
    line: int,
    r: dict[str, str],
    profiles: Mapping[tuple[str, WorkloadKind], FillProfile],
    known: list[str],
    seen: set[str],
) -> TraceJob:
    where = f"{p} line {line}"
    job_id = (r.get("job_id") or "").strip() or f"line-{line}"
    if job_id in seen:
        raise TraceError(f"{where}: job_id {job_id!r} appears twice; give each job a unique id")
    seen.add(job_id)
    arrival = _num(where, "arrival_s", r.get("arrival_s"))
    model, kind_text = (r.get("model") or "").strip(), (r.get("kind") or "").strip()
    try:
        kind = WorkloadKind.parse(kind_text, "kind")
    except ValueError as e:
        raise TraceError(f"{where}: {e}; known profiles: {', '.join(known)}") from None
    if (model, kind) not in profiles:
        raise TraceError(f"{where}: no profile for model {model!r} kind {kind.label!r}; known: {', '.join(known)}")
    if (r.get("samples") or "").strip():
        samples = _num(where, "samples", r.get("samples"))
    else:
        samples = _num(where, "steps", r.get("steps")) * _num(where, "batch_size", r.get("batch_size"))
    if samples < 1 or samples != int(samples):
        raise TraceError(f"{where}: samples must be a whole number >= 1, got {samples:g}")
    dl_text = (r.get("deadline_s") or "").strip()
    deadline = _num(where, "deadline_s", dl_text) if dl_text else None
    if deadline is not None and deadline < arrival:
        raise TraceError(f"{where}: deadline_s {deadline:g} is before arrival_s {arrival:g}; fix the row")
    return TraceJob(job_id, arrival, model, kind, int(samples), deadline)


def _num(where: str, col: str, text: str | None) -> float:
    try:
        v = float((text or "").strip())
    except ValueError:
        raise TraceError(f"{where}: {col} must be a number, got {text!r}") from None
    if not math.isfinite(v) or v < 0:
        raise TraceError(f"{where}: {col} must be a finite number >= 0, got {text!r}")
    return v
