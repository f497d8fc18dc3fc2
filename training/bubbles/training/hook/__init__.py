"""The training-side hook: time a DeepSpeed ``PipelineEngine``'s instructions, profile each stage's bubble
cycle, and signal every bubble to the node's listeners (the agent and armed fill jobs).

- ``profile``: pure: instruction streams -> candidate waits -> a stage's bubble cycle;
- ``listeners``: the non-blocking datagram sockets every signal goes out on;
- ``collectives``: the interposer on DeepSpeed's communication backend that times collectives inside instructions;
- ``timing``: how waits are timed: host stamps (CPU/gloo) or device events read on a helper thread (GPUs);
- ``instrumentation``: ``instrument(engine)``, ``Instrumentation`` and ``Unattached`` (the fail-open result);
- the card it leaves for the node's agent, and the card's lock, are ``bubbles.core.card``'s (the agent reads them).

Candidate bubbles are the waits that really block a stage on others: ``RecvActivation``, ``RecvGrad``,
``SendActivation``, ``SendGrad`` (a send waits for its receiver), the collectives inside ``OptimizerStep`` (gradient
clipping's norm all-reduce, overflow checks), ``ReduceGrads`` and ``ReduceTiedGrads`` (``collectives``), and the
end-of-batch loss broadcast.

Fail open: listeners are reached with a non-blocking ``sendto``; a missing or dead listener is dropped, a full one
loses that datagram. Any exception in the hook's own bookkeeping is logged once and switches signalling off;
exceptions raised by DeepSpeed's handlers propagate unchanged. The hook never touches tensors, so the training's
losses are bit-identical with and without it.
"""

from .instrumentation import (
    ITERATION_HISTORY,
    RECENT_ITERATIONS,
    REPREDICT_EVERY,
    TIMINGS,
    Instrumentation,
    Unattached,
    instrument,
    resolve_timing,
    stage_rank_of,
)
from .listeners import MAX_LISTENERS, Listeners
from .profile import (
    LOSS_BROADCAST,
    SEND_INSTRUCTIONS,
    WAIT_INSTRUCTIONS,
    Candidate,
    build_cycle,
    candidate_slots,
    instruction_stream,
)

__all__ = [
    "ITERATION_HISTORY",
    "LOSS_BROADCAST",
    "MAX_LISTENERS",
    "RECENT_ITERATIONS",
    "REPREDICT_EVERY",
    "SEND_INSTRUCTIONS",
    "TIMINGS",
    "WAIT_INSTRUCTIONS",
    "Candidate",
    "Instrumentation",
    "Listeners",
    "Unattached",
    "build_cycle",
    "candidate_slots",
    "instruction_stream",
    "instrument",
    "resolve_timing",
    "stage_rank_of",
]
