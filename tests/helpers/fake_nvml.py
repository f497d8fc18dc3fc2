"""Builds tests/helpers/fake_nvml.c into a ``libnvidia-ml.so.1`` for machines without a GPU: the node agent's
real NVML path (nvidia-ml-py loading the library by its soname) then lists the GPUs named in
``$BUBBLES_FAKE_NVML_UUIDS``. Used by the real-node tier to have the kubelet call the agent's device plugin."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("fake_nvml.c")
SONAME = "libnvidia-ml.so.1"
UUIDS_ENV = "BUBBLES_FAKE_NVML_UUIDS"


class NoCompiler(RuntimeError):
    """No C compiler here: the caller skips what needs the library, saying why."""


def build(out_dir: Path) -> Path:
    """``out_dir/libnvidia-ml.so.1``, compiled from the source (again when the source is newer)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise NoCompiler("no C compiler (cc) to build the stand-in NVML library; apt-get install gcc")
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / SONAME
    if not lib.exists() or lib.stat().st_mtime < SOURCE.stat().st_mtime:
        subprocess.run([cc, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", f"-Wl,-soname,{SONAME}", "-o", str(lib),
                        str(SOURCE)], check=True, capture_output=True, text=True)
    return lib
