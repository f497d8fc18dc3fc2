"""What an install of bubbles carries: the operator runs without torch or DeepSpeed, the extras' dependency
closures keep them out (followed through the installed metadata), every pin lives in constraints.txt, and the
wheel built from this tree holds the product and nothing else."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "deepspeed")
SOURCE_ROOTS = ("core", "training", "agent", "operator", "demo")

# Run in a fresh interpreter: a finder placed first on sys.meta_path refuses torch and DeepSpeed (and their
# submodules), as on an install of the `operator` extra where neither exists. Prints one JSON line.
BLOCKED_INTERPRETER = r"""
import contextlib, importlib.abc, io, json, sys

BLOCKED = {"torch", "deepspeed"}

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ImportError(f"{name} is refused in this interpreter", name=name)
        return None

sys.meta_path.insert(0, Refuse())
out = {}
if sys.argv[1] == "control":
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        out["refused"] = str(exc)
    else:
        out["refused"] = None
else:
    from bubbles import cli

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            cli.main(["operator", "--help"])
        except SystemExit as exc:
            out["help_exit"] = exc.code
        else:
            out["help_exit"] = "returned instead of exiting"
    out["help"] = stdout.getvalue()
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        out["run_rc"] = cli.main(["operator", "--interval", "0"])
    out["run_stderr"] = stderr.getvalue()
    import bubbles.core.api, bubbles.core.wire, bubbles.operator.cli, bubbles.operator.scheduler  # noqa: E401,F401
    out["imported"] = True
    out["loaded_by_cli"] = sorted({m.partition(".")[0] for m in sys.modules} & {"torch", "deepspeed", "kopf",
                                                                                  "kubernetes"})
    # The whole operator process: its modules, kopf and the Kubernetes client, a registry of its handlers.
    import bubbles.operator.shell as shell
    from bubbles.operator.agents import InMemoryAgents
    from bubbles.operator.kube import Connection
    op = shell.Operator(shell.OperatorConfig(), Connection("http://127.0.0.1:1"), InMemoryAgents())
    op.registry()
    out["operator_built"] = True
out["loaded"] = sorted({m.partition(".")[0] for m in sys.modules} & {"torch", "deepspeed", "kopf", "kubernetes"})
print(json.dumps(out))
"""


def run_blocked(mode: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", BLOCKED_INTERPRETER, mode], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_the_blocker_refuses_torch() -> None:
    # The control for the test below: torch is installed here (the dev extra), and the finder still keeps it out.
    assert metadata.version("torch")
    out = run_blocked("control")
    assert out["refused"] == "torch is refused in this interpreter"
    assert out["loaded"] == []


def test_operator_runs_where_torch_and_deepspeed_cannot_be_imported() -> None:
    out = run_blocked("operator")
    assert out["help_exit"] == 0
    for flag in ("--namespace", "--all-namespaces", "--metrics-port", "--metrics-addr", "--leader-election",
                 "--no-leader-election", "--lease-name", "--lease-namespace", "--agent-port", "--log-level"):
        assert flag in out["help"], flag
    # A bad flag is refused with what to fix, before anything connects.
    assert out["run_rc"] == 2 and "--interval must be > 0 seconds" in out["run_stderr"]
    assert out["imported"] is True
    # --help, the flag check and the imports load neither torch, DeepSpeed, kopf nor kubernetes ...
    assert out["loaded_by_cli"] == [], f"loaded by --help, a run or the imports: {out['loaded_by_cli']}"
    # ... and the whole operator (kopf, the Kubernetes client, its handlers) builds without torch or DeepSpeed.
    assert out["operator_built"] is True and out["loaded"] == ["kopf", "kubernetes"], out["loaded"]


# --- The installed metadata: what each extra pulls in --------------------------------------------------------


def requirements(dist: str) -> list[Requirement]:
    return [Requirement(r) for r in metadata.requires(dist) or []]


def applies(req: Requirement, extras: frozenset[str]) -> bool:
    """Whether ``req`` is in force on this interpreter for an install of its distribution with ``extras``."""
    if req.marker is None:
        return True
    return any(req.marker.evaluate({"extra": extra}) for extra in (extras or {""}))


def closure(extras: set[str]) -> tuple[dict[str, list[str]], set[str]]:
    """Every distribution an install of ``bubbles[extras]`` pulls in on this interpreter, each with the path
    that reaches it, following the installed distributions' own requirements (their extras and markers
    honoured). Returns (canonical name -> path, names that are required but not installed)."""
    reached: dict[str, list[str]] = {"bubbles": ["bubbles"]}
    missing: set[str] = set()
    queue: list[tuple[str, frozenset[str]]] = [("bubbles", frozenset(extras))]
    done: set[tuple[str, frozenset[str]]] = set()
    while queue:
        name, dist_extras = queue.pop()
        if (name, dist_extras) in done:
            continue
        done.add((name, dist_extras))
        try:
            reqs = requirements(name)
        except metadata.PackageNotFoundError:
            missing.add(name)
            continue
        for req in reqs:
            if not applies(req, dist_extras):
                continue
            dep = canonicalize_name(req.name)
            reached.setdefault(dep, [*reached[name], dep])
            queue.append((dep, frozenset(req.extras)))
    return reached, missing


@pytest.mark.parametrize("extra", ["", "agent", "operator"])
def test_torch_and_deepspeed_are_unreachable_from(extra: str) -> None:
    reached, missing = closure({extra} - {""})
    assert not missing, f"required but not installed, so not followed: {sorted(missing)}"
    for heavy in HEAVY:
        assert heavy not in reached, f"bubbles[{extra}] pulls in {heavy}: {' -> '.join(reached[heavy])}"
    if extra == "operator":  # the closure is followed at all: the operator's own dependencies are in it
        assert {"kopf", "kubernetes", "prometheus-client", "numpy", "aiohttp"} <= reached.keys()


def test_the_demo_extra_reaches_torch_and_deepspeed() -> None:
    # The control: the same walk finds torch where it is required.
    reached, missing = closure({"demo"})
    assert not missing
    assert reached["torch"] == ["bubbles", "torch"]
    assert "deepspeed" in reached
    assert {"sympy", "networkx"} <= reached.keys()  # followed into torch's own requirements


def test_every_requirement_in_the_metadata_has_a_version_range() -> None:
    unbounded = [str(r) for r in requirements("bubbles") if canonicalize_name(r.name) != "bubbles" and not r.specifier]
    assert not unbounded, (f"give these a range in pyproject.toml (the exact pin goes in constraints.txt), then "
                           f"re-install (make setup): {unbounded}")


def read_constraints() -> dict[str, Requirement]:
    pins: dict[str, Requirement] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            name = canonicalize_name(req.name)
            assert name not in pins, f"{req.name} is pinned twice in constraints.txt"
            pins[name] = req
    return pins


def test_every_distribution_of_the_dev_install_is_pinned_in_constraints() -> None:
    pins = read_constraints()
    reached, missing = closure({"dev"})
    assert not missing
    unpinned = sorted(set(reached) - {"bubbles"} - set(pins))
    assert not unpinned, f"not pinned in constraints.txt (make constraints): {unpinned}"
    loose = sorted(str(r) for r in pins.values() if [s.operator for s in r.specifier] != ["=="])
    assert not loose, f"constraints.txt pins with == only: {loose}"
    assert str(pins["torch"].specifier) == "==2.13.0"
    # The venv was built from these pins (a local build tag such as 2.13.0+cpu matches ==2.13.0).
    drift = sorted(f"{name} {metadata.version(name)} (pinned {pins[name].specifier})"
                   for name in set(reached) - {"bubbles"} - set(unpinned)
                   if Version(metadata.version(name)) not in pins[name].specifier)
    assert not drift, f"installed versions differ from constraints.txt: {drift}"


# --- The wheel -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[zipfile.ZipFile]:
    """The wheel built from this tree by its own build backend (hatchling, from pyproject's [build-system]).
    pip builds it in an isolated environment: hatchling is not part of the dev install."""
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(ROOT)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"building the wheel failed:\n{proc.stdout}\n{proc.stderr}"
    (path,) = out.glob("bubbles-*.whl")
    with zipfile.ZipFile(path) as zf:
        yield zf


def test_the_wheel_holds_every_source_file_of_the_product(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    for must in ("bubbles/core/api.py", "bubbles/core/wire.py", "bubbles/cli.py", "bubbles/hook.py", "bubbles/sdk.py",
                 "bubbles/training/__init__.py", "bubbles/agent/server.py", "bubbles/operator/scheduler/policies.py",
                 "bubbles/operator/simulator/engine.py", "bubbles/operator/simulator/data/model_profiles.json",
                 "bubbles/operator/__init__.py", "bubbles/operator/cli.py", "bubbles/demo/cli.py",
                 "bubbles/demo/orchestrate/phases.py", "bubbles/fill_examples/spin.py"):
        assert must in names, must
    # Every source file of every source root is in the wheel, at its place in the one `bubbles` package.
    for root in SOURCE_ROOTS:
        for path in (ROOT / root / "bubbles").rglob("*"):
            if path.is_file() and path.suffix in {".py", ".json"} and "__pycache__" not in path.parts:
                rel = path.relative_to(ROOT / root).as_posix()
                assert rel in names, f"{root}/{rel} is not in the wheel"


def test_the_wheel_holds_nothing_else(wheel: zipfile.ZipFile) -> None:
    names = wheel.namelist()
    tops = {n.split("/", 1)[0] for n in names}
    assert tops == {"bubbles", "bubbles-0.1.0.dist-info"}, tops  # no gpubench, benchmarks, tests, operator, ...
    for name in names:
        assert not re.search(r"(^|/)(gpubench|benchmarks|tests|__pycache__)(/|$)", name), name
        assert not name.endswith((".pyc", ".pyo")), name


def test_the_installed_metadata_is_this_trees(wheel: zipfile.ZipFile) -> None:
    # The metadata checks above read the installed distribution; it must say what pyproject.toml says now.
    built = metadata.PathDistribution(zipfile.Path(wheel, "bubbles-0.1.0.dist-info/"))
    assert sorted(built.requires or []) == sorted(metadata.requires("bubbles") or []), \
        "the installed bubbles is stale: re-install it (make setup)"
    entry_points = {(ep.group, ep.name): ep.value for ep in built.entry_points}
    assert entry_points[("console_scripts", "bubbles")] == "bubbles.cli:main"
    assert entry_points[("bubbles.policies", "fifo")] == "bubbles.operator.scheduler.policies:FifoPolicy"


def _cli_without(blocked: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """``bubbles ARGV`` in an interpreter where ``blocked`` (and its submodules) cannot be imported, as on an install
    without the extra that brings it."""
    code = ("import sys\n"
            f"sys.modules[{blocked!r}] = None\n"
            "from bubbles.cli import main\n"
            f"sys.exit(main({list(argv)!r}))\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_the_command_lists_its_parts_on_any_install_and_a_missing_extra_is_named() -> None:
    """`bubbles --help` imports no subcommand (the agent's image has no numpy, the operator's no torch); a command
    whose extra is missing says which extra to install instead of a traceback."""
    for argv in (["--help"], []):
        r = _cli_without("numpy", *argv)
        out = r.stdout + r.stderr
        assert "Traceback" not in out and all(c in out for c in ("demo", "agent", "simulate", "operator")), out
    assert _cli_without("numpy", "--help").returncode == 0
    typo = _cli_without("numpy", "agnet")
    assert typo.returncode == 2 and "invalid choice: 'agnet'" in typo.stderr and "Traceback" not in typo.stderr
    sim = _cli_without("numpy", "simulate", "--help")
    assert sim.returncode == 2 and "bubbles[simulate]" in sim.stderr and "Traceback" not in sim.stderr, sim.stderr
    assert _cli_without("numpy", "agent", "--help").returncode == 0  # the agent's own install has no numpy
