"""Whether this machine lets the tests make bind mounts (the CSI plugin's mount(2)): root, and a kernel that allows
it here. Shared by the CSI tests, which skip with the reason where it does not."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from bubbles.agent.csi.mounts import KernelMounter


def why_no_bind_mounts(needs: str) -> str | None:
    """Why bind mounts cannot be made here (``needs``: what the test needs root for, said in the skip), or None."""
    if os.geteuid() != 0:
        return f"needs root: {needs}"
    with tempfile.TemporaryDirectory(prefix="bubbles-mount-probe-") as d:
        src, dst = Path(d, "a"), Path(d, "b")
        src.mkdir()
        dst.mkdir()
        try:
            KernelMounter().bind(str(src), str(dst))
        except OSError as exc:
            return f"cannot bind-mount here: {exc}"
        KernelMounter().unmount(str(dst))
    return None
