"""bubbles.operator: the control-plane operator that will reconcile FillJob and PipelineTraining resources.

What exists: ``bubbles.operator.cli``, the ``bubbles operator`` command line with every flag the operator
will take (namespaces, metrics endpoint, Lease leader election, the node agents' port, log level). Running it
says the reconcilers are not built yet and exits 2.

Planned (the operator issue): the kopf reconcilers, which place fill jobs with ``bubbles.scheduler`` and talk
to the node agents over gRPC. Layer rule (import-linter contract ``operator`` in pyproject.toml): nothing here
imports torch, DeepSpeed, the hook, the SDK or the agent; the operator's image installs only the ``operator``
extra (kopf, kubernetes, prometheus-client, numpy). kopf and kubernetes are imported inside the functions that
need them, never at module level, so ``bubbles operator --help`` works on any install.
"""
