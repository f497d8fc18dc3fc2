"""Exactly the Kubernetes API access the operator uses: one list of RBAC rules, the single source for the
Helm chart's ClusterRole and for the real-API-server tests that run the operator under it.

Each rule says why it is there. ``kubectl auth can-i`` checks in tests/test_operator_kube.py hold the
operator to these rules: every call it makes is allowed and nothing else is granted.
"""

from __future__ import annotations

from typing import Any

from bubbles.core.resources import GROUP

RULES: list[dict[str, Any]] = [
    # Watch the custom resources; patch a FillJob's metadata to add or remove the clean-up finalizer.
    {"apiGroups": [GROUP], "resources": ["filljobs"], "verbs": ["get", "list", "watch", "patch"]},
    {"apiGroups": [GROUP], "resources": ["pipelinetrainings"], "verbs": ["get", "list", "watch"]},
    # Write what the operator observed: status only (the spec is the user's).
    {"apiGroups": [GROUP], "resources": ["filljobs/status", "pipelinetrainings/status"], "verbs": ["patch"]},
    # A fill Pod is owned by its FillJob with blockOwnerDeletion: where the OwnerReferencesPermissionEnforcement
    # admission plugin runs (OpenShift, hardened clusters), setting that needs update on the owner's finalizers.
    {"apiGroups": [GROUP], "resources": ["filljobs/finalizers"], "verbs": ["update"]},
    # Find the training Pods (and their nodes), create each fill job's Pod next to them, delete it when done.
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "create", "delete"]},
    # Tell people what happened (placements, evictions, failures).
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    # Leader election between replicas.
    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "update"]},
]


def cluster_role(name: str = "bubbles-operator") -> dict[str, Any]:
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": name},
            "rules": RULES}


def cluster_role_binding(namespace: str, service_account: str, name: str = "bubbles-operator") -> dict[str, Any]:
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": service_account, "namespace": namespace}]}
