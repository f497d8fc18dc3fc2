"""Fill job: batched inference with a small transformer-encoder classifier under ``torch.no_grad``."""

from __future__ import annotations

from bubbles.fill_examples._counted import FlopCountedJob


class BatchInference(FlopCountedJob):
    """Classifies batches of synthetic token sequences; sized to ~1 ms a step on one core.

    ``batch_size``, ``seq_len`` and ``width`` (model dimension) set the step time; ``steps`` (optional)
    makes the job finish after that many batches (a finite inference job).
    """

    def __init__(self, batch_size: int = 16, seq_len: int = 16, width: int = 64, layers: int = 1,
                 vocab: int = 1000, classes: int = 10, steps: int | None = None, seed: int = 0) -> None:
        if min(batch_size, seq_len, width, layers) < 1 or width % 4:
            raise ValueError("batch_size, seq_len, layers must be >= 1 and width a positive multiple of 4")
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.width = width
        self.layers = layers
        self.vocab = vocab
        self.classes = classes
        self.max_steps = steps
        self.seed = seed
        self.steps_done = 0
        self.step_flops: float | None = None
        self.predictions = 0

    def create(self) -> None:
        import torch
        from torch import nn

        # The fused fast path of nn.TransformerEncoderLayer is one opaque operator that
        # FlopCounterMode cannot see into; the plain path computes the same result.
        torch.backends.mha.set_fastpath_enabled(False)
        torch.manual_seed(self.seed)
        layer = nn.TransformerEncoderLayer(self.width, nhead=4, dim_feedforward=2 * self.width,
                                           batch_first=True, dropout=0.0)
        self.embed = nn.Embedding(self.vocab, self.width)
        self.encoder = nn.TransformerEncoder(layer, self.layers, enable_nested_tensor=False)
        self.head = nn.Linear(self.width, self.classes)
        for m in (self.embed, self.encoder, self.head):
            m.eval()
        g = torch.Generator().manual_seed(self.seed)
        self.tokens = torch.randint(0, self.vocab, (4, self.batch_size, self.seq_len), generator=g)
        self.device = "cpu"

    def init(self) -> None:
        import torch

        if torch.cuda.is_available():
            self.device = "cuda"
            for m in (self.embed, self.encoder, self.head):
                m.to(self.device)
            self.tokens = self.tokens.to(self.device)

        self._count_first_step()  # outside the bubbles: see the package doc

    def _work(self) -> None:
        import torch

        with torch.no_grad():
            x = self.embed(self.tokens[self.steps_done % self.tokens.shape[0]])
            logits = self.head(self.encoder(x).mean(dim=1))
            self.predictions += int(logits.argmax(dim=1).numel())
