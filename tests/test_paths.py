"""Where every part looks for the node's run directory when nobody says (core/bubbles/paths.py)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from bubbles.core import paths

NOBODY = 65534


def _as_nobody(mounted: Path, env: dict[str, str] | None = None) -> str:
    """default_run_dir() in a child that dropped to an unprivileged user, the way a training Pod runs (runAsUser).
    A fork, not an exec: the interpreter lives under /root, which that user cannot read."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        try:
            os.environ.pop(paths.RUN_DIR_ENV, None)
            os.environ.update(env or {})
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.write(w, str(paths.default_run_dir(mounted)).encode())
        except BaseException as exc:
            os.write(w, f"child failed: {exc!r}".encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    _, status = os.waitpid(pid, 0)
    assert status == 0 and out, "the unprivileged child failed"
    return out


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_a_run_dir_mounted_under_a_root_owned_parent_is_found_by_a_non_root_process() -> None:
    # A Pod: /run is root's, /run/bubbles is the node's run directory (a hostPath) owned by the agent's user.
    # (Not under pytest's tmp_path: its parents are private to root, and the other user must reach it.)
    top = Path(tempfile.mkdtemp(prefix="bubbles-paths-"))
    top.chmod(0o755)
    try:
        _check(top)
    finally:
        shutil.rmtree(top)


def _check(top: Path) -> None:
    run = top / "run"
    run.mkdir(mode=0o755)
    mounted = run / "bubbles"
    mounted.mkdir(mode=0o700)
    os.chown(mounted, NOBODY, NOBODY)
    assert _as_nobody(mounted) == str(mounted)
    # Someone else's directory there is not this user's: the per-user fallback, as before.
    os.chown(mounted, 0, 0)
    assert _as_nobody(mounted) == f"/tmp/bubbles-{NOBODY}"
    # Nothing there and the parent not writable: the fallback too.
    mounted.rmdir()
    assert _as_nobody(mounted) == f"/tmp/bubbles-{NOBODY}"
    # $BUBBLES_RUN_DIR wins over all of it.
    assert _as_nobody(mounted, {paths.RUN_DIR_ENV: "/somewhere/else"}) == "/somewhere/else"


def test_a_writable_parent_means_the_directory_is_made_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(paths.RUN_DIR_ENV, raising=False)
    assert paths.default_run_dir(tmp_path / "bubbles") == tmp_path / "bubbles"


def test_a_path_in_a_pods_own_directory_is_checked_as_the_pod_sees_it() -> None:
    """The agent binds in a Pod's directory (<run_dir>/_pods/<uid>/...) through a descriptor of it, and the Pod's
    processes reach the socket in their mount at /run/bubbles: that is the path whose length counts."""
    uid = "f3167451-05c2-4ef2-99ef-54b016717434"
    node = Path("/run/bubbles/_pods") / uid / "ml/llama-pp/stage-0/rank-0/fills/fill-image-classification-a1.sock"
    assert paths.as_the_pod_sees(node) == Path("/run/bubbles/ml/llama-pp/stage-0/rank-0/fills/"
                                                 "fill-image-classification-a1.sock")
    assert paths.socket_path_problem(node) is not None  # 122 bytes on the node (the real node's case, 2026-11-29)
    assert paths.socket_path_problem(paths.as_the_pod_sees(node)) is None
    # Anything else as it is: the node's own tree, and a path that only ends in the Pods' directory.
    for other in ("/run/bubbles/ml/t/stage-0/rank-0/agent.sock", "/run/bubbles/_pods", "/run/bubbles/_pods/uid"):
        assert paths.as_the_pod_sees(other) == Path(other)
