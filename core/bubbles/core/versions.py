"""The release a process runs, and the words a peer refused for its protocol version gets.

The parts of bubbles are upgraded apart: the hook with the training's image, the SDK with each fill image, the agent
and the operator with the chart. So each seam carries a version and checks it, and a refusal names both versions and
what to upgrade. The seams and their versions: the hook card (``bubbles.core.card.VERSION``), the bubble datagrams
(``bubbles.core.wire.VERSION``), the agent <-> fill process control channel (``bubbles.core.control.VERSION``) and the
operator <-> agent API (``bubbles.core.agentapi.API_VERSION``). docs/upgrading.md has the table of which release
speaks which.
"""

from __future__ import annotations

from importlib import metadata


def release() -> str:
    """This process's bubbles release ("0.1.0"), or "unknown" where bubbles runs from a source tree not installed."""
    try:
        return metadata.version("bubbles")
    except metadata.PackageNotFoundError:
        return "unknown"


def needs_newer(who: str, protocol: str, theirs: int, needed: int, upgrade: str) -> str:
    """The refusal for a peer speaking ``protocol`` v``theirs`` where this side needs v``needed``: it says which side
    to upgrade (``upgrade``, e.g. "bubbles in the training's image") and to which release (this process's)."""
    return (f"{who} speaks {protocol} v{theirs}; this side needs v{needed}: upgrade {upgrade} to release "
            f"{release()} (this side's) or later")
