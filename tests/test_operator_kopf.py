"""The operator's use of kopf: event handlers only, so kopf's diff base can keep nothing (shell._no_diff_base)."""

from __future__ import annotations

import copy

from bubbles.operator.agents import InMemoryAgents
from bubbles.operator.kube import Connection
from bubbles.operator.shell import Operator, OperatorConfig


def _operator() -> Operator:
    return Operator(OperatorConfig(), Connection("http://127.0.0.1:9", insecure=True), InMemoryAgents())


def test_the_registry_holds_event_handlers_only() -> None:
    """A change handler (on.create, on.update, on.field, a daemon) would need kopf's diff base, which the settings
    turn off: this fails if one is added without giving kopf a real diff base again."""
    reg = _operator().registry()
    assert not reg._changing.get_all_handlers()
    assert not reg._spawning.get_all_handlers()
    assert not reg._indexing.get_all_handlers()
    assert len(reg._watching.get_all_handlers()) == 3  # FillJobs, PipelineTrainings, Pods


def test_the_diff_base_copies_nothing_and_writes_nothing() -> None:
    import kopf

    storage = _operator().settings().persistence.diffbase_storage
    body = kopf.Body({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "annotations": {"a": "b"}},
                      "spec": {"containers": [{"name": "c", "image": "i"}]}})
    before = copy.deepcopy(dict(body))
    assert storage.build(body=body) == {}
    assert storage.fetch(body=body) is None
    patch = kopf.Patch()
    storage.store(body=body, patch=patch, essence={"spec": {}})
    assert not patch  # nothing is written to our objects
    assert dict(body) == before
