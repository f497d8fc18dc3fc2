"""The container images (images/*/Dockerfile), checked without a container engine: every path they copy exists, they
are multi-stage and pinned, they run as a non-root user, their entry point is a program the image's install provides,
and each image's install set resolves with the pinned constraints without torch or DeepSpeed where none belongs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.real_node import PROJECT_IMAGES, ClusterUnavailable, build_image

ROOT = Path(__file__).resolve().parent.parent
IMAGES = sorted(p.parent.name for p in (ROOT / "images").glob("*/Dockerfile"))
EXTRA = {"operator": "[operator]", "agent": "[agent]", "fill-job": ""}


def instructions(name: str) -> list[tuple[str, str]]:
    text = (ROOT / "images" / name / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def test_there_is_an_image_for_each_part() -> None:
    assert IMAGES == ["agent", "fill-job", "operator"]


@pytest.mark.parametrize("name", IMAGES)
def test_every_copied_path_exists_and_the_build_is_multi_stage_pinned_and_non_root(name: str) -> None:
    ins = instructions(name)
    base = next(rest for op, rest in ins if op == "ARG" and rest.startswith("BASE="))
    assert re.match(r"^BASE=[\w./-]+:\d+\.\d+\.\d+[\w.-]*$", base), f"{name}: pin the base image's version ({base})"
    froms = [rest for op, rest in ins if op == "FROM"]
    assert len(froms) >= 2 and all(f.startswith("${BASE}") for f in froms), f"{name}: multi-stage on ARG BASE"
    ignored = (ROOT / ".dockerignore").read_text().split()
    for op, rest in ins:
        if op != "COPY" or "--from=" in rest:
            continue
        *sources, _dest = rest.split()
        for src in sources:
            assert (ROOT / src).exists(), f"{name}: COPY {src}: no such path in the repository"
            assert not any(src.rstrip("/") == i.rstrip("/") for i in ignored), f"{name}: {src} is in .dockerignore"
    user = [rest for op, rest in ins if op == "USER"][-1]
    assert re.match(r"^[1-9]\d*:[1-9]\d*$", user), f"{name}: run as a numeric non-root user, not {user!r}"


@pytest.mark.parametrize("name", IMAGES)
def test_the_entry_point_is_a_program_the_image_installs(name: str) -> None:
    entry = json.loads(next(rest for op, rest in instructions(name) if op == "ENTRYPOINT"))
    if entry[0].endswith("/bubbles"):
        import tomllib

        scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
        assert "bubbles" in scripts  # the console script the install creates
        cmd = json.loads(next(rest for op, rest in instructions(name) if op == "CMD"))
        result = subprocess.run([sys.executable, "-m", "bubbles.cli", *cmd, "--help"], capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0, result.stderr
    else:
        assert entry[:3] == ["python", "-m", "bubbles.sdk"]
        import importlib.util

        assert importlib.util.find_spec("bubbles.sdk") is not None


@pytest.mark.parametrize("name", IMAGES)
def test_each_images_install_set_resolves_with_the_pins(name: str, tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed", "--report", str(report),
         "-c", str(ROOT / "constraints.txt"), f"{ROOT}{EXTRA[name]}"],
        capture_output=True, text=True, timeout=300)
    if result.returncode != 0 and ("Could not fetch" in result.stderr or "NewConnectionError" in result.stderr):
        pytest.skip(f"no package index reachable: {result.stderr.strip().splitlines()[-1]}")
    assert result.returncode == 0, result.stderr
    names = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    assert "bubbles" in names
    assert not names & {"torch", "deepspeed"}, f"{name}: pulls in {names & {'torch', 'deepspeed'}}"
    if name == "operator":
        assert {"kopf", "kubernetes", "grpcio"} <= names
    if name == "agent":
        assert {"grpcio", "grpcio-health-checking", "nvidia-ml-py"} <= names and "kopf" not in names


def _requirements_script(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "images" / "requirements.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=60)


def _names(requirements: list[str]) -> set[str]:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    return {canonicalize_name(Requirement(r).name) for r in requirements}


@pytest.mark.parametrize("extra", ["operator", "agent", "demo"])
def test_the_dependency_layer_installs_what_the_projects_metadata_requires(extra: str) -> None:
    """images/requirements.py against the installed project's own metadata (hatchling's Requires-Dist), read an
    independent way: an extra naming other extras of bubbles brings theirs. A dependency it left out would be
    installed by the project's own install after the code is copied: correct, but no longer cached."""
    import importlib.metadata

    from packaging.requirements import Requirement

    def required(extras: set[str]) -> set[str]:
        names: set[str] = set()
        for line in importlib.metadata.requires("bubbles") or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras):
                if req.name == "bubbles":
                    names |= required(set(req.extras))
                else:
                    names |= _names([line])
        return names

    result = _requirements_script(extra)
    assert result.returncode == 0, result.stderr
    assert _names(result.stdout.splitlines()) == required({extra})


@pytest.mark.parametrize("name", ["operator", "agent"])
def test_the_dependencies_are_installed_before_the_code_is_copied(name: str) -> None:
    ins = instructions(name)
    deps = next(i for i, (op, rest) in enumerate(ins) if op == "RUN" and "-r requirements.txt" in rest)
    assert f"requirements.py {name} " in ins[deps][1]
    code = next(i for i, (op, rest) in enumerate(ins) if op == "COPY" and rest.startswith("core/"))
    assert deps < code, f"{name}: the dependency layer must come before the code, or every change reinstalls it"
    assert not any(op == "COPY" and rest.split()[0].rstrip("/") in {"core", "training", "agent", "operator", "demo"}
                   for op, rest in ins[:deps]), f"{name}: code copied before the dependency layer"


def test_the_requirements_script_refuses_bad_input_saying_what_to_do(tmp_path: Path) -> None:
    unknown = _requirements_script("operatr")
    assert unknown.returncode == 2 and not unknown.stdout
    assert "no extra 'operatr'" in unknown.stderr and "agent, demo, dev, operator, simulate" in unknown.stderr
    usage = _requirements_script()
    assert usage.returncode == 2 and "usage: python3 images/requirements.py EXTRA" in usage.stderr
    flag = _requirements_script("--all")
    assert flag.returncode == 2 and "usage:" in flag.stderr
    elsewhere = _requirements_script("operator", cwd=tmp_path)
    assert elsewhere.returncode == 2 and "no pyproject.toml in" in elsewhere.stderr


@pytest.mark.image
@pytest.mark.timeout(900)
def test_the_operator_image_builds_offline_and_runs_as_its_user_without_torch() -> None:
    """A real build (buildah, no registry, wheels from the host), then the image's own entry point run in it."""
    import os
    import shutil

    base = os.environ.get("BUBBLES_IMAGE_BASE")
    if not base or not shutil.which("buildah"):
        pytest.skip("IMAGE BUILD SKIPPED: no local base image (make test sets BUBBLES_IMAGE_BASE from "
                    "tools/image-base.sh, which needs root, apt-get, buildah and debootstrap)")
    env = {**os.environ, "STORAGE_DRIVER": os.environ.get("STORAGE_DRIVER", "vfs")}
    try:
        tag = build_image("operator")  # the build the cluster tier installs too (once per session)
    except ClusterUnavailable as exc:
        pytest.skip(f"IMAGE BUILD SKIPPED: {exc}")

    def buildah(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["buildah", *args], env=env, capture_output=True, text=True, timeout=300)

    config = json.loads(buildah("inspect", "--type", "image", tag).stdout)["OCIv1"]["config"]
    assert config["User"] == "65532:65532" and config["Entrypoint"] == ["/opt/bubbles/bin/bubbles"]
    container = buildah("from", tag).stdout.strip()
    try:
        run = buildah("run", "--isolation", "chroot", "--user", config["User"], container, "--",
                      *config["Entrypoint"], *config["Cmd"], "--help")
        assert run.returncode == 0 and "usage: bubbles operator" in run.stdout, run.stderr
        probe = buildah("run", "--isolation", "chroot", "--user", config["User"], container, "--",
                        "/opt/bubbles/bin/python", "-c",
                        "import importlib.util as u, os; print(u.find_spec('torch') is None, "
                        "u.find_spec('kopf') is not None, os.getuid())")
        assert probe.stdout.split() == ["True", "True", "65532"], probe.stderr
    finally:
        buildah("rm", container)


def test_the_default_tag_is_the_name_the_chart_pulls() -> None:
    """`REGISTRY=... images/build.sh agent` then `helm install --set image.registry=...`: one name, no retagging."""
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.helm import container, render

    def tag(what: str, **env: str) -> str:
        r = subprocess.run([str(ROOT / "images" / "build.sh"), what], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PRINT_TAG": "1", **env}, cwd=ROOT)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    docs = render({"image": {"registry": "registry.example.com/ml"}})
    assert tag("agent", REGISTRY="registry.example.com/ml") == container(docs, "DaemonSet")["image"]
    assert tag("operator", REGISTRY="registry.example.com/ml") == container(docs, "Deployment")["image"]
    version = re.search(r'^appVersion: *"?([^"\n]+)"?', (ROOT / "helm/bubbles/Chart.yaml").read_text(), re.M)
    assert version is not None and tag("fill-job") == f"bubbles-fill-job:{version[1]}"
    bad = subprocess.run([str(ROOT / "images" / "build.sh"), "sidecar"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PRINT_TAG": "1"}, cwd=ROOT)
    assert bad.returncode == 2 and "no images/sidecar/Dockerfile" in bad.stderr


def test_every_image_is_titled_so_that_the_suite_prunes_what_its_rebuilds_replace() -> None:
    """The suite rebuilds the images on every run and removes the untagged ones a rebuild leaves, found by their
    title label (real_node.prune_replaced_images): an image without a known title would pile up in buildah's storage."""
    titles = {name: re.findall(r'org\.opencontainers\.image\.title="([^"]+)"',
                               (ROOT / "images" / name / "Dockerfile").read_text()) for name in IMAGES}
    assert titles == {name: [f"bubbles-{name}"] for name in IMAGES}
    assert sorted(PROJECT_IMAGES) == sorted(f"bubbles-{name}" for name in IMAGES)
