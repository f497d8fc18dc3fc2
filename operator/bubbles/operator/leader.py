"""Leader election on a coordination.k8s.io/v1 Lease (kopf's peering pauses by priority; it does not elect).

``decide_lease`` is the pure rule; ``LeaseElector`` applies it every ``renew_s`` with optimistic concurrency
(an update carries the resourceVersion it read, so two replicas cannot both win). A leader that cannot
renew stops acting as soon as its own lease could have expired (``is_leader`` reads the clock), even if it
cannot reach the API server to learn that another replica took over. A replica takes over only a Lease whose
record it has seen unchanged for the lease's duration by its own clock (no wall clocks compared). The leader's
writes time out (``KubeWriter``'s request timeout, a fifth of the lease) before its validity ends, so no write of
a deposed leader lands after another replica may have taken over.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger("bubbles.operator.leader")


def _parse(t: str | None) -> dt.datetime | None:
    if not t:
        return None
    return dt.datetime.fromisoformat(t.replace("Z", "+00:00"))


def decide_lease(spec: Mapping[str, Any] | None, me: str, unchanged_for_s: float) -> str:
    """``"create"`` (no Lease yet), ``"renew"`` (ours), ``"take"`` (released, or another holder's record has not
    changed for longer than its duration) or ``"wait"``.

    ``unchanged_for_s`` is how long this replica has seen the same record (resourceVersion), by its own monotonic
    clock: as client-go's leader election does, expiry never compares another machine's wall clock (``renewTime``)
    with ours, so clock skew between replicas cannot make two leaders.
    """
    if spec is None:
        return "create"
    holder = spec.get("holderIdentity")
    if holder == me:
        return "renew"
    duration = int(spec.get("leaseDurationSeconds") or 0)
    if not holder or unchanged_for_s > duration:
        return "take"
    return "wait"


def _micro(t: dt.datetime) -> str:
    return t.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseElector:
    """Holds (or waits for) the Lease ``namespace/name`` as ``identity``."""

    def __init__(self, api_client: Any, namespace: str, name: str, identity: str, *, lease_s: int = 15,
                 renew_s: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC)) -> None:
        import kubernetes

        self._k = kubernetes
        self.api: Any = kubernetes.client.CoordinationV1Api(api_client)
        self.namespace, self.name, self.identity = namespace, name, identity
        self.lease_s, self.renew_s = lease_s, renew_s
        self.clock, self.wall = clock, wall
        self._valid_until = -1.0
        self._seen: tuple[str, float] | None = None  # (resourceVersion, when first seen by self.clock)
        self.transitions = 0
        self.changed = asyncio.Event()

    @property
    def is_leader(self) -> bool:
        """True only while our last successful renewal is younger than the lease (minus a safety margin)."""
        return self.clock() < self._valid_until

    def try_once(self) -> bool:
        """One acquire-or-renew round (blocking); whether we hold the Lease afterwards."""
        k = self._k
        start = self.clock()
        now = self.wall()
        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace)
            spec = lease.spec.to_dict() if lease.spec else {}
            spec = {"holderIdentity": spec.get("holder_identity"), "leaseDurationSeconds":
                    spec.get("lease_duration_seconds"), "renewTime": _iso(spec.get("renew_time")),
                    "acquireTime": _iso(spec.get("acquire_time")), "leaseTransitions": spec.get("lease_transitions")}
        except k.client.ApiException as exc:
            if exc.status != 404:
                raise
            lease, spec = None, None
        unchanged_for = 0.0
        if lease is not None:
            rv = str(lease.metadata.resource_version)
            if self._seen is None or self._seen[0] != rv:
                self._seen = (rv, start)
            unchanged_for = start - self._seen[1]
        action = decide_lease(spec, self.identity, unchanged_for)
        body = {"holderIdentity": self.identity, "leaseDurationSeconds": self.lease_s, "renewTime": _micro(now)}
        try:
            if action == "create":
                self.api.create_namespaced_lease(self.namespace, {
                    "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace},
                    "spec": {**body, "acquireTime": _micro(now), "leaseTransitions": 0}})
            elif action in ("renew", "take"):
                assert lease is not None and spec is not None
                new_spec = dict(body)
                if action == "take":
                    new_spec["acquireTime"] = _micro(now)
                    new_spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
                self.api.replace_namespaced_lease(self.name, self.namespace, {
                    "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace,
                                 "resourceVersion": lease.metadata.resource_version},
                    "spec": {**{k2: v for k2, v in spec.items() if v is not None}, **new_spec}})
            else:
                return self._set(False)
        except k.client.ApiException as exc:
            if exc.status in (409, 422):  # another replica won this round
                return self._set(False)
            raise
        # Valid from when we asked, not from when the answer came: the other replicas count from the renewTime.
        self._valid_until = start + self.lease_s * 0.8
        return self._set(True)

    def _set(self, leader: bool) -> bool:
        if not leader:
            was = self._valid_until > 0 and self.is_leader
            self._valid_until = -1.0
            if was:
                log.warning("lost the lease %s/%s: stopping all actions", self.namespace, self.name)
                self.changed.set()
            return False
        if not getattr(self, "_held", False):
            self.transitions += 1
            log.info("acquired the lease %s/%s as %s", self.namespace, self.name, self.identity)
            self.changed.set()
        self._held = True
        return True

    async def run(self, stop: asyncio.Event) -> None:
        """Acquire and renew until ``stop``; an API error counts as not holding the Lease this round.

        On the way out a held Lease is released (its holder cleared) so another replica takes over at once.
        """
        while not stop.is_set():
            try:
                held = await asyncio.to_thread(self.try_once)
            except Exception as exc:
                log.warning("lease round failed: %s", exc)
                held = self.is_leader
            if not held:
                self._held = False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.renew_s if held else self.renew_s / 2)
        if self.is_leader:
            await asyncio.to_thread(self.release)

    def release(self) -> None:
        self._valid_until = -1.0  # stop acting first: the Lease may be someone else's a moment from now
        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace)
            if lease.spec and lease.spec.holder_identity == self.identity:
                lease.spec.holder_identity = None
                self.api.replace_namespaced_lease(self.name, self.namespace, lease)
        except Exception as exc:  # best effort: the lease expires anyway
            log.info("could not release the lease: %s", exc)
        self._valid_until = -1.0


def _iso(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, dt.datetime):
        return _micro(v)
    return str(v)
