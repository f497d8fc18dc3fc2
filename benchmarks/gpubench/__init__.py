"""The one-GPU harvesting benchmark (``benchmarks/gpu_harvest.py``): an emulated pipeline stage with real
compute, the real hook, agent and fill jobs, and FreeRide's metrics. See docs/benchmarks.md."""
