"""DeepSpeed's CPU shared-memory op, which the demo's training never uses, left unbuilt.

On the CPU accelerator ``deepspeed.init_distributed`` JIT-builds ``deepspeed_shm_comm`` in every rank, through
``torch.utils.cpp_extension.load``: a C++ compile of 30 to 60 s on 2 cores, done again whenever the virtual
environment's path changes (the build directory is keyed by the op's name, its commands by the venv's paths). The op
serves one call, ``inference_all_reduce``, which a pipeline-parallel training does not make: its stages talk by
send and receive, and its losses are reduced with the plain ``all_reduce``. So the demo's training tells DeepSpeed the
op is not available on this machine, as DeepSpeed itself does on a platform without it, and gloo carries everything.

Leaving it unbuilt also removes a hang: torch guards the build with a ``lock`` file only its creator removes, so a
rank killed during the build (a Ctrl-C in a first ``make demo``) used to leave every later launch waiting on it.
"""

from __future__ import annotations

import sys

OP = "deepspeed_shm_comm"


def skip_unused_cpu_ops() -> bool:
    """Mark DeepSpeed's CPU shared-memory op unavailable, before ``init_distributed`` would build it. Returns whether
    it did; fails open (DeepSpeed then builds the op itself, as without this) and says so."""
    try:
        import deepspeed.ops

        compatible = deepspeed.ops.__compatible_ops__  # computed on first access: a dict of op name -> bool
        if not isinstance(compatible, dict):
            raise TypeError(f"deepspeed.ops.__compatible_ops__ is a {type(compatible).__name__}, not a dict")
        compatible[OP] = False
        return True
    except Exception as exc:  # the launch goes on as without this
        print(f"bubbles: could not tell DeepSpeed to skip its {OP} op ({type(exc).__name__}: {exc}); DeepSpeed "
              "builds it itself (30 to 60 s once per machine and virtual environment)", file=sys.stderr, flush=True)
        return False
