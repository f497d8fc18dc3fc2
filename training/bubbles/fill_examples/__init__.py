"""Example fill jobs that run on CPU: a small CNN training step, a batched inference step, and a gang's
tensor-parallel inference step (``gang_inference``: one process per GPU, all-reducing among them each step).

Both count their step's FLOPs once, with ``torch.utils.flop_counter.FlopCounterMode`` on the first
step, and report that figure for every later step: the counter intercepts every operator, which
would make each counted step several times slower than the bubble it is meant to fit in. The shapes
do not change between steps, so the count does not either.

That first step runs in ``init()``, outside the bubbles: it also pays torch's one-time costs (kernel
selection, allocator warm-up), tens of milliseconds on this CPU, which no bubble holds; run inside a
bubble it would overrun and the agent's watchdog would kill the job. Fill jobs should do all such
one-time work in ``init()``.
"""
