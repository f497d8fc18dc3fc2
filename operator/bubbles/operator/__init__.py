"""bubbles.operator: the kopf operator that reconciles FillJob and PipelineTraining resources.

Not built yet (its own issue): this package exists so the source layout, the packaging and the layering
checks cover it from the start. Layer rule: it talks to node agents over gRPC and imports nothing from
DeepSpeed or the hook.
"""
