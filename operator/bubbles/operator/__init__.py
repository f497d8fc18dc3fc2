"""bubbles.operator: the control-plane operator that reconciles FillJob and PipelineTraining resources.

``decide`` holds every decision as a pure function; ``shell`` runs kopf's watches and the reconcile loop;
``kube`` writes to the API; ``leader`` elects one acting replica on a Lease; ``crd`` and ``rbac`` are the
CRDs' and the RBAC rules' single source. ``agents.AgentDirectory`` is the interface to the node agents;
``grpc_agents.GrpcAgents`` implements it over their gRPC service (mutual TLS and/or a bearer token).

Layer rule (import-linter contract ``operator`` in pyproject.toml): nothing here imports torch, DeepSpeed, the
hook, the SDK or the agent; the operator's image installs only the ``operator`` extra. kopf and kubernetes are
imported inside the functions that need them, never at module level, so ``bubbles operator --help`` works on
any install.
"""
