"""Fill job: batched inference with a transformer-encoder classifier under ``torch.no_grad``.

Defaults are sized to ~1 ms a step on one CPU core. ``bert_base()`` gives the arguments of a BERT-base
shaped encoder (width 768, 12 layers, 12 heads, feed-forward 3072, sequence 128) in bf16 for GPUs, where a
step of 32 sequences is a few milliseconds of a large GPU.
"""

from __future__ import annotations

from typing import Any

from bubbles.fill_examples._counted import FlopCountedJob, check_cuda_graphs, check_dtype, parse_step_sizes


class BatchInference(FlopCountedJob):
    """Classifies batches of synthetic token sequences.

    ``batch_size``, ``seq_len``, ``width`` (model dimension), ``layers``, ``heads`` and ``ffn`` (feed-forward
    width; default 2 x width) set the step time; ``dtype`` the precision (``"float32"`` or ``"bfloat16"``);
    ``steps`` (optional) makes the job finish after that many batches (a finite inference job); ``step_sizes``
    the part-batches a step may classify where a whole one does not fit (default a quarter, a half and the
    whole batch; ``[]``: whole batches only). The job runs on the device the agent assigned
    (``bubbles.sdk.assigned_device()``).

    ``cuda_graphs`` (CUDA only): each step size's forward pass is captured once as a CUDA graph at init and
    replayed by every step, so a step costs the device's work and one launch instead of a launch per kernel and
    the modules' Python (on an H100 the eager steps were launch-bound: 5.5-6.0 ms at 8, 16 and 32 sequences of a
    BERT-base encoder under MPS; docs/gpu.md). The graphs' speed-up has not been measured yet.
    """

    def __init__(self, batch_size: int = 16, seq_len: int = 16, width: int = 64, layers: int = 1,
                 vocab: int = 1000, classes: int = 10, steps: int | None = None, seed: int = 0,
                 heads: int = 4, ffn: int | None = None, dtype: str = "float32",
                 step_sizes: list[int] | None = None, cuda_graphs: bool = False) -> None:
        if min(batch_size, seq_len, width, layers, heads, vocab) < 1 or width % heads:
            raise ValueError("batch_size, seq_len, layers, heads and vocab must be >= 1 and width a positive "
                             f"multiple of heads ({heads}), got width {width}")
        if ffn is not None and ffn < 1:
            raise ValueError(f"ffn (feed-forward width) must be >= 1 or omitted (2 x width), got {ffn}")
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.width = width
        self.layers = layers
        self.heads = heads
        self.ffn = ffn if ffn is not None else 2 * width
        self.vocab = vocab
        self.classes = classes
        self.max_steps = steps
        self.seed = seed
        self.dtype = check_dtype(dtype)
        self.step_sizes = parse_step_sizes(step_sizes, batch_size)
        self.cuda_graphs = check_cuda_graphs(cuda_graphs)
        self.graphs = {}  # size -> (graph, (static tokens,), static logits)
        self.steps_done = 0
        self.step_flops: float | None = None
        self.predictions = 0

    @staticmethod
    def bert_base(batch_size: int = 32, **overrides: Any) -> dict[str, Any]:
        """Keyword arguments of a BERT-base shaped job in bf16 (for a spec's ``args``)."""
        return {"batch_size": batch_size, "seq_len": 128, "width": 768, "layers": 12, "heads": 12, "ffn": 3072,
                "vocab": 30522, "dtype": "bfloat16", **overrides}

    def create(self) -> None:
        import torch
        from torch import nn

        # The fused fast path of nn.TransformerEncoderLayer is one opaque operator that
        # FlopCounterMode cannot see into; the plain path computes the same result.
        torch.backends.mha.set_fastpath_enabled(False)
        torch.manual_seed(self.seed)
        layer = nn.TransformerEncoderLayer(self.width, nhead=self.heads, dim_feedforward=self.ffn,
                                           batch_first=True, dropout=0.0)
        self.embed = nn.Embedding(self.vocab, self.width)
        self.encoder = nn.TransformerEncoder(layer, self.layers, enable_nested_tensor=False)
        self.head = nn.Linear(self.width, self.classes)
        for m in (self.embed, self.encoder, self.head):
            m.to(self.torch_dtype())
            m.eval()
        g = torch.Generator().manual_seed(self.seed)
        self.tokens = torch.randint(0, self.vocab, (4, self.batch_size, self.seq_len), generator=g)
        self.device = "cpu"

    def init(self) -> None:
        import torch

        device = self.target_device()
        self._require_cuda_for_graphs(device)
        if device != "cpu":
            self.device = device
            for m in (self.embed, self.encoder, self.head):
                m.to(device)
            self.tokens = self.tokens.to(device)
        self._count_first_step()  # outside the bubbles: see the package doc (eager: the FLOP counter sees it)
        if self.cuda_graphs:
            with torch.no_grad():
                self._capture_graphs(lambda size: (self.tokens[0][:size].clone(),), self._forward)

    def _forward(self, tokens: Any) -> Any:
        x = self.embed(tokens)
        return self.head(self.encoder(x).mean(dim=1))

    def _work(self, size: int) -> None:
        import torch

        tokens = self.tokens[self.steps_done % self.tokens.shape[0]][:size]
        logits = self._replay(size, (tokens,))
        if logits is None:
            with torch.no_grad():
                logits = self._forward(tokens)
        self.predictions += int(logits.argmax(dim=1).numel())
