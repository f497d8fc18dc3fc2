"""The shared core: the API types and protocols every part loads (inside the training, on the node, in the control
plane). Pure Python and the standard library (PyYAML for spec files); the agent API's gRPC stubs in ``agentapi``
add gRPC and protobuf. Nothing here imports another part of bubbles or a framework (torch, kopf, kubernetes)."""
