"""What the local orchestrators share (``bubbles demo`` and the GPU benchmark in ``benchmarks/``): starting and
stopping the agent and the training as child processes, and the interleaved fill-mode phases they run.
Installed because ``bubbles demo`` needs it; nothing inside the training, on the node or in the control
plane imports it."""
