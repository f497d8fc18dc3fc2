"""The node agent: executors that drive fill jobs in the bubbles of a local pipeline training.

Modules: ``spec`` (fill-job spec files), ``launcher`` (starting fill processes), ``server`` (the
event loop, executors, watchdog, slowdown guard, ledgers), ``isolation`` (isolation modes, failing
closed), ``mps`` (the MPS control program's client), ``metrics`` (Prometheus), ``cluster`` (a node's trainings,
the operator's assignments, attaching fill Pods), ``csi`` (the CSI node plugin for Pods' node-local volumes,
``--csi``), ``cli`` (``bubbles agent``). Nothing here imports torch.
"""
