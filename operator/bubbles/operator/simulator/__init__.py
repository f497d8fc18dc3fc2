"""An event-driven simulator of bubble harvesting on a cluster (PipeFill section 5.1).

``mainjob`` turns a small description of the pipeline training into bubble cycles per stage,
``trace`` reads and generates fill-job traces, ``engine`` runs them through the scheduler,
``report`` and ``plot`` say what was recovered. Pure Python and numpy; matplotlib only for plots.
"""

from bubbles.operator.simulator.engine import JobOutcome, SimResult, simulate
from bubbles.operator.simulator.mainjob import MainJob
from bubbles.operator.simulator.profiles import load_profiles
from bubbles.operator.simulator.report import summarize
from bubbles.operator.simulator.trace import TraceJob, generate_trace, read_alibaba, read_trace, write_trace

__all__ = [
    "JobOutcome",
    "MainJob",
    "SimResult",
    "TraceJob",
    "generate_trace",
    "load_profiles",
    "read_alibaba",
    "read_trace",
    "simulate",
    "summarize",
    "write_trace",
]
