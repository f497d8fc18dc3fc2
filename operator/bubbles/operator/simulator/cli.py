"""`bubbles simulate`: how much would bubble harvesting recover on a cluster? (event-driven simulator)

The main job comes from flags or a config file (JSON or YAML with the same names), the fill jobs
from a trace CSV (--trace), generated from the Alibaba GPU trace (--alibaba) as PipeFill section
5.3 does, or, with neither, generated the same way from a model of that trace packaged with bubbles
(``simulator/data/alibaba2023_trace_model.json``); one simulation runs per --policy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bubbles.operator.scheduler.core import FillJobRequest
    from bubbles.operator.simulator.mainjob import MainJob

ALIBABA_ENV = "BUBBLES_ALIBABA_TRACE"
DEFAULT_PLOT = Path("bubbles-simulate.png")
FLAGS_HINT = (
    "What changes what: --stages, --microbatches, --schedule, --fwd-ms, --bwd-ms (the training's pipeline and so its "
    "bubbles); --gpus (cluster size); --free-gib, --fill-fraction (what each bubble offers); --jobs, --hours, --seed, "
    "--deadline-share (the fill-job load); --init-s (each job's start-up); --gang-share, --gang-gpus (jobs over "
    "several GPUs); --policy, repeated to compare; --alibaba "
    "PATH (the real trace) or --trace CSV (your own jobs); --report FILE (JSON). `bubbles simulate --help` lists them "
    "all."
)
CONFIG_KEYS = {
    "stages": int,
    "microbatches": int,
    "gpus": int,
    "data_parallel": int,
    "tensor_parallel": int,
    "schedule": str,
    "fwd_ms": float,
    "bwd_ms": float,
    "free_gib": float,
    "fill_fraction": float,
    "hours": float,
}
DEFAULTS: dict[str, Any] = {
    "stages": 16,
    "microbatches": 8,
    "tensor_parallel": 1,
    "schedule": "gpipe",
    "fwd_ms": 40.0,
    "bwd_ms": 80.0,
    "free_gib": 4.5e9 / 2**30,
    "fill_fraction": 0.68,
    "hours": 24.0,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("main job (flags override --config)")
    g.add_argument("--config", type=Path, help="JSON or YAML file with any of: " + ", ".join(CONFIG_KEYS))
    # The training's shape, TP x PP x DP: --tensor-parallel x --stages x --data-parallel (or --gpus), with the short
    # names --tp --pp --dp. Every GPU of a stage has its own bubbles; the simulator's executor classes are the stages,
    # each of dp x tp GPUs (the operator's executors are single GPUs: see docs/simulator.md).
    g.add_argument("--stages", "--pp", type=int, help="pipeline stages p (default 16)")
    g.add_argument("--microbatches", type=int, help="micro-batches m per replica and iteration (default 8)")
    g.add_argument("--gpus", type=int, help="GPUs of the main job (default 8192 = stages x dp x tp)")
    g.add_argument("--data-parallel", "--dp", type=int, help="data-parallel degree, instead of --gpus")
    g.add_argument("--tensor-parallel", "--tp", type=int, help="GPUs per stage and replica (default 1)")
    g.add_argument("--schedule", help="gpipe or 1f1b (default gpipe)")
    g.add_argument("--fwd-ms", type=float, help="forward time per micro-batch and stage, ms (default 40)")
    g.add_argument("--bwd-ms", type=float, help="backward time per micro-batch and stage, ms (default 80)")
    g.add_argument(
        "--free-gib", type=float, help="GPU memory free for fill jobs in bubbles, GiB (default 4.19 = 4.5 GB)"
    )
    g.add_argument(
        "--fill-fraction", type=float, help="share of each bubble offered to fill jobs (default 0.68)"
    )
    g.add_argument("--hours", type=float, help="simulated hours of the main job (default 24)")
    f = p.add_argument_group("fill jobs")
    f.add_argument(
        "--trace", type=Path, help="fill-job trace CSV (arrival_s, model, kind, samples or steps and batch_size, "
                                   "deadline_s; optional job_id: docs/simulator.md)"
    )
    f.add_argument(
        "--alibaba",
        type=Path,
        help=f"Alibaba GPU trace pod list to generate jobs from (default ${ALIBABA_ENV}; with neither this nor "
        "--trace, a model of that trace packaged with bubbles)",
    )
    f.add_argument("--jobs", type=int, default=2000, help="jobs to generate over --hours (default 2000)")
    f.add_argument("--seed", type=int, default=0, help="random seed of the generator (default 0)")
    f.add_argument(
        "--deadline-share",
        type=float,
        default=0.0,
        help="share of generated jobs with a deadline (10x their isolated run time, plus --init-s; default 0)",
    )
    f.add_argument(
        "--init-s",
        type=float,
        default=0.0,
        help="seconds each fill job holds its GPU's bubbles before its first step (its Pod starting, its model "
        "loading); counted in its completion time, not in the recovered work (default 0)",
    )
    f.add_argument(
        "--gang-share",
        type=float,
        default=0.0,
        help="share of the trace's jobs that are gang jobs, each on --gang-gpus GPUs of one stage at once, in the "
        "bubbles they share (drawn with --seed; default 0: none)",
    )
    f.add_argument(
        "--gang-gpus", type=int, default=2, help="GPUs each gang job runs on together (default 2)"
    )
    f.add_argument("--write-trace", type=Path, help="save the generated trace as CSV here")
    f.add_argument("--profiles", type=Path, help="model profiles JSON (default: the packaged estimates)")
    o = p.add_argument_group("scheduling and output")
    o.add_argument(
        "--policy",
        action="append",
        help="scheduling policy; repeat to compare (default sjf). Weighted: '0.7*deadline+0.3*fifo'",
    )
    o.add_argument(
        "--drain",
        action="store_true",
        help="keep the main job running until every fill job is done (for makespan comparisons)",
    )
    o.add_argument("--report", type=Path, help="write the JSON report here")
    o.add_argument(
        "--plot",
        type=Path,
        default=DEFAULT_PLOT,
        help="write a PNG here: recovered utilization vs cluster size (one policy) or JCT per policy "
        f"(default {DEFAULT_PLOT})",
    )
    o.add_argument("--no-plot", action="store_true", help="write no plot")
    o.add_argument("--quiet", action="store_true", help="no progress bar")


def load_config(path: Path) -> dict[str, Any]:
    """Read a main-job config file; raise ValueError saying what to fix."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"cannot read config {path}: {e.strerror}; pass an existing file") from None
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            doc = yaml.safe_load(text)
        else:
            doc = json.loads(text)
    except Exception as e:  # json and yaml raise different types; both mean "fix the syntax"
        raise ValueError(
            f"config {path} cannot be parsed ({e}); write JSON (or YAML with a .yaml name)"
        ) from None
    if not isinstance(doc, dict):
        raise ValueError(f"config {path} must be a mapping of {', '.join(CONFIG_KEYS)}")
    out: dict[str, Any] = {}
    for k, v in doc.items():
        key = str(k).replace("-", "_")
        if key not in CONFIG_KEYS:
            raise ValueError(f"config {path}: unknown key {k!r}; known keys: {', '.join(CONFIG_KEYS)}")
        typ = CONFIG_KEYS[key]
        ok = (
            isinstance(v, str)
            if typ is str
            else (
                isinstance(v, int | float)
                and not isinstance(v, bool)
                and (typ is float or float(v).is_integer())
            )
        )
        if not ok:
            raise ValueError(
                f"config {path}: {k} must be {'a whole number' if typ is int else typ.__name__}, got {v!r}"
            )
        out[key] = typ(v)
    return out


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """Defaults < config file < flags."""
    cfg = dict(DEFAULTS)
    if args.config is not None:
        cfg.update(load_config(args.config))
    for k in CONFIG_KEYS:
        v = getattr(args, k, None)
        if v is not None:
            cfg[k] = v
    return cfg


def validate(args: argparse.Namespace, cfg: dict[str, Any]) -> list[str]:
    """Every problem with the flags and config, each saying what to do."""
    errs = []
    for k in ("stages", "microbatches", "tensor_parallel"):
        if cfg[k] < 1:
            errs.append(f"--{k.replace('_', '-')} {cfg[k]}: use 1 or more")
    if "gpus" in cfg and "data_parallel" in cfg:
        errs.append("give --gpus or --data-parallel, not both")
    if cfg.get("gpus") is not None and cfg["stages"] >= 1 and cfg["tensor_parallel"] >= 1:
        unit = cfg["stages"] * cfg["tensor_parallel"]
        if cfg["gpus"] < unit or cfg["gpus"] % unit:
            errs.append(
                f"--gpus {cfg['gpus']}: must be a positive multiple of stages x tensor-parallel ({unit})"
            )
    if cfg.get("data_parallel") is not None and cfg["data_parallel"] < 1:
        errs.append(f"--data-parallel {cfg['data_parallel']}: use 1 or more")
    if cfg["schedule"] not in ("gpipe", "1f1b"):
        errs.append(f"--schedule {cfg['schedule']!r}: use gpipe or 1f1b")
    for k in ("fwd_ms", "bwd_ms", "hours"):
        if not cfg[k] > 0:
            errs.append(f"--{k.replace('_', '-')} {cfg[k]}: must be > 0")
    if not cfg["free_gib"] >= 0:
        errs.append(f"--free-gib {cfg['free_gib']}: must be >= 0")
    if not 0 < cfg["fill_fraction"] <= 1:
        errs.append(f"--fill-fraction {cfg['fill_fraction']}: must be in (0, 1]")
    if args.jobs < 1:
        errs.append(f"--jobs {args.jobs}: generate at least 1 job")
    if not 0 <= args.deadline_share <= 1:
        errs.append(f"--deadline-share {args.deadline_share}: must be in [0, 1]")
    if not 0 <= args.init_s <= 86400:  # NaN included
        errs.append(f"--init-s {args.init_s}: must be seconds from 0 to 86400 (a day)")
    if not 0 <= args.gang_share <= 1:
        errs.append(f"--gang-share {args.gang_share}: must be in [0, 1]")
    if args.gang_gpus < 1:
        errs.append(f"--gang-gpus {args.gang_gpus}: use 1 or more")
    if args.trace is not None and args.alibaba is not None:
        errs.append("give --trace or --alibaba, not both")
    return errs


def _alibaba_path(args: argparse.Namespace) -> Path | None:
    if args.alibaba is not None:
        return Path(args.alibaba)
    env = os.environ.get(ALIBABA_ENV)
    return Path(env) if env else None


def _progress(label: str) -> Any:
    """A progress bar redrawn in place on a terminal; in a log (not a TTY), one line per 25%."""
    start = time.monotonic()
    tty = sys.stderr.isatty()
    last_quarter = [-1]

    def show(frac: float) -> None:
        n = int(frac * 30)
        line = f"{label:<16} [{'#' * n}{'.' * (30 - n)}] {frac:5.1%} {time.monotonic() - start:6.1f}s"
        if tty:
            sys.stderr.write("\r" + line + ("\n" if frac >= 1.0 else ""))
        else:
            quarter = int(frac * 4)
            if quarter == last_quarter[0]:
                return
            last_quarter[0] = quarter
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    return show


def run(args: argparse.Namespace) -> int:
    """Run the simulations; exit 2 with a message on bad input."""
    try:
        cfg = settings(args)
    except ValueError as e:
        print(f"bubbles simulate: error: {e}", file=sys.stderr)
        return 2
    errs = validate(args, cfg)
    if errs:
        for msg in errs:
            print(f"bubbles simulate: error: {msg}", file=sys.stderr)
        return 2

    from bubbles.operator.scheduler.policies import UnknownPolicyError, get_policy
    from bubbles.operator.simulator.engine import simulate
    from bubbles.operator.simulator.mainjob import MainJob
    from bubbles.operator.simulator.profiles import load_profiles
    from bubbles.operator.simulator.report import comparison, format_summary, summarize
    from bubbles.operator.simulator.trace import (
        AlibabaTask,
        TaskColumns,
        TraceError,
        TraceJob,
        TraceTable,
        generate_table,
        load_trace_model,
        read_alibaba,
        read_trace,
        with_gangs,
        write_trace,
    )

    policies = args.policy or ["sjf"]
    try:
        for name in policies:
            get_policy(name)
        profiles = load_profiles(args.profiles)
        if cfg.get("data_parallel") is not None:
            dp = cfg["data_parallel"]
        elif cfg.get("gpus") is not None:
            dp = cfg["gpus"] // (cfg["stages"] * cfg["tensor_parallel"])
        else:
            dp = max(1, 8192 // (cfg["stages"] * cfg["tensor_parallel"]))
        main = MainJob(
            stages=cfg["stages"],
            microbatches=cfg["microbatches"],
            data_parallel=dp,
            tensor_parallel=cfg["tensor_parallel"],
            schedule=cfg["schedule"],
            fwd_s=cfg["fwd_ms"] / 1e3,
            bwd_s=cfg["bwd_ms"] / 1e3,
            free_bytes=int(cfg["free_gib"] * 2**30),
            fill_fraction=cfg["fill_fraction"],
        )
        trace: list[TraceJob] | TraceTable
        if args.trace is not None:
            trace = read_trace(args.trace, profiles)
        else:
            path = _alibaba_path(args)
            tasks: list[AlibabaTask] | TaskColumns
            if path is not None:
                tasks, stats = read_alibaba(path)
                print(
                    f"Alibaba trace: {stats.candidates} GPU tasks not latency-sensitive, "
                    f"{stats.share_kept:.1%} under {stats.cap_gpu_hours:g} GPU-hour (PipeFill: 81.6%)"
                )
            else:
                model = load_trace_model()
                tasks = model.columns(max(2 * args.jobs, 2000), seed=args.seed)
                print(f"fill jobs: {args.jobs} generated from {model.describe()}; --alibaba PATH uses the real "
                      "trace, --trace CSV your own jobs")
            trace = generate_table(
                tasks,
                profiles,
                jobs=args.jobs,
                hours=cfg["hours"],
                seed=args.seed,
                deadline_share=args.deadline_share,
                setup_s=args.init_s,
            )
            if args.write_trace is not None:
                write_trace(args.write_trace, trace.rows())
    except (UnknownPolicyError, TraceError, ValueError) as e:
        print(f"bubbles simulate: error: {e}", file=sys.stderr)
        return 2

    fill_jobs = (trace.fill_jobs(profiles, setup_s=args.init_s) if isinstance(trace, TraceTable)
                 else [t.to_fill_job(profiles, setup_s=args.init_s) for t in trace])
    jobs = with_gangs(fill_jobs, args.gang_share, args.gang_gpus, seed=args.seed)
    gpus_per_stage = main.gpus // main.stages
    if args.gang_share > 0 and args.gang_gpus > gpus_per_stage:
        print(f"bubbles simulate: error: --gang-gpus {args.gang_gpus}: a stage has {gpus_per_stage} GPUs (dp x tp); "
              "ask for at most that many", file=sys.stderr)
        return 2
    hours = None if args.drain else cfg["hours"]
    show = not args.quiet and len(jobs) >= 1000
    # With one policy the plot is a cluster-size sweep: the smaller sizes run beside the main run, in a forked
    # process where there is a second CPU (they need nothing from it; the full size is the main run itself).
    sweep_plan = [] if args.no_plot or len(policies) > 1 else _sweep_sizes(main)
    sweep_job = _SweepInChild.start(main, jobs, policies[0], hours, sweep_plan) if sweep_plan else None
    summaries = []
    for name in policies:
        res = simulate(main, jobs, name, hours=hours, progress=_progress(name) if show else None)
        summaries.append(summarize(res))
    print(format_summary(summaries))
    for summ in summaries:
        j = summ["jobs"]
        if summ["bubble_time_filled_share"] < 0.5 and j["unfinished"] <= 0.1 * max(1, j["submitted"]):
            print(f"{summ['policy']}: the fill jobs kept {summ['bubble_time_filled_share']:.1%} of bubble time busy "
                  f"and {j['completed']} of {j['submitted']} finished: the load, not the bubbles, limits what is "
                  "recovered; more fill jobs (--jobs) would recover more")

    report = comparison(summaries)
    if not args.no_plot:
        from bubbles.operator.simulator.plot import plot_jct, plot_sweep

        if len(summaries) > 1:
            plot_jct(args.plot, summaries)
        else:
            smaller = sweep_job.result() if sweep_job is not None else _run_sweep(main, jobs, policies[0], hours,
                                                                                   sweep_plan)
            sweep = [*smaller, summaries[0]]  # the full size: the run above (a simulation is deterministic)
            report["sweep"] = [
                {k: s[k] for k in ("gpus", "bubble_ratio", "recovered_tflops_per_gpu", "gpu_equivalents")}
                for s in sweep
            ]
            plot_sweep(args.plot, sweep)
        print(f"plot: {args.plot}")
    if args.report is not None:
        args.report.write_text(json.dumps(report, indent=2))
        print(f"report: {args.report}")
    print(FLAGS_HINT)
    return 0


def _sweep_sizes(main: MainJob) -> list[int]:
    """The sweep's smaller cluster sizes, as fractions 1/frac of ``main`` (8, 4, 2: those that make a smaller
    pipeline-complete cluster)."""
    out = []
    for frac in (8, 4, 2):
        small = main.with_gpus(main.gpus // frac)
        if small.gpus >= main.stages * main.tensor_parallel and small.gpus != main.gpus:
            out.append(frac)
    return out


def _run_sweep(main: MainJob, jobs: Sequence[FillJobRequest], policy: str, hours: float | None,
               fracs: Sequence[int]) -> list[dict[str, Any]]:
    """The sweep's runs: 1/frac of the GPUs with every frac-th job (the same load per GPU)."""
    from bubbles.operator.simulator import simulate, summarize

    return [summarize(simulate(main.with_gpus(main.gpus // frac), jobs[::frac], policy, hours=hours))
            for frac in fracs]


class _SweepInChild:
    """The sweep run by a forked child (which inherits the jobs without copying them) while the parent runs the main
    simulation; ``result()`` waits for it. Where there is one CPU or no fork, it runs in the parent when asked."""

    def __init__(self, proc: Any, conn: Any, args: tuple[Any, ...]) -> None:
        self.proc, self.conn, self.args = proc, conn, args

    @classmethod
    def start(cls, main: MainJob, jobs: Sequence[FillJobRequest], policy: str, hours: float | None,
              fracs: Sequence[int]) -> _SweepInChild:
        import multiprocessing

        args = (main, jobs, policy, hours, fracs)
        if len(os.sched_getaffinity(0)) < 2 or "fork" not in multiprocessing.get_all_start_methods():
            return cls(None, None, args)
        ctx = multiprocessing.get_context("fork")
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=cls._child, args=(child, args), name="bubbles-simulate-sweep", daemon=True)
        proc.start()
        child.close()
        return cls(proc, parent, args)

    @staticmethod
    def _child(conn: Any, args: tuple[Any, ...]) -> None:
        try:
            conn.send(("ok", _run_sweep(*args)))
        except BaseException as exc:  # said in the parent, which then runs the sweep itself
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        finally:
            conn.close()

    def result(self) -> list[dict[str, Any]]:
        if self.proc is None:
            return _run_sweep(*self.args)
        try:
            status, value = self.conn.recv()
        except EOFError:
            status, value = "error", f"the sweep's process ended with code {self.proc.exitcode}"
        self.proc.join()
        if status != "ok":
            print(f"bubbles simulate: the plot's sweep failed in its own process ({value}); running it here",
                  file=sys.stderr)
            return _run_sweep(*self.args)
        return list(value)
