"""Fill job: train a small CNN on synthetic 32x32 images (CIFAR-sized), one optimizer step per step()."""

from __future__ import annotations

from typing import Any

from bubbles.fill_examples._counted import FlopCountedJob


class ImageClassification(FlopCountedJob):
    """A two-convolution CNN trained with SGD on random images and labels; sized to ~1 ms a step on one core.

    ``batch_size`` and ``width`` (channels of the first convolution) set the step time; ``steps``
    (optional) makes the job finish after that many steps.
    """

    def __init__(self, batch_size: int = 4, width: int = 8, classes: int = 10, steps: int | None = None,
                 seed: int = 0) -> None:
        if batch_size < 1 or width < 1 or classes < 2:
            raise ValueError("batch_size and width must be >= 1 and classes >= 2")
        self.batch_size = batch_size
        self.width = width
        self.classes = classes
        self.max_steps = steps
        self.seed = seed
        self.steps_done = 0
        self.step_flops: float | None = None
        self.last_loss = float("nan")

    def create(self) -> None:
        import torch
        from torch import nn

        g = torch.Generator().manual_seed(self.seed)
        w = self.width
        self.model = nn.Sequential(
            nn.Conv2d(3, w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 16x16
            nn.Conv2d(w, 2 * w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(4),  # 4x4
            nn.Flatten(), nn.Linear(2 * w * 16, self.classes),
        )
        # A few fixed batches cycled through: data loading is not what this example measures.
        self.images = torch.randn(4, self.batch_size, 3, 32, 32, generator=g)
        self.labels = torch.randint(0, self.classes, (4, self.batch_size), generator=g)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.loss_fn = nn.CrossEntropyLoss()
        self.device = "cpu"

    def init(self) -> None:
        import torch

        if torch.cuda.is_available():
            self.device = "cuda"
            self.model.to(self.device)
            self.images = self.images.to(self.device)
            self.labels = self.labels.to(self.device)

        self._count_first_step()  # outside the bubbles: see the package doc

    def _work(self) -> None:
        i = self.steps_done % self.images.shape[0]
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(self.images[i]), self.labels[i])
        loss.backward()  # counted: training FLOPs are forward + backward
        self.optimizer.step()
        self.last_loss = float(loss.detach())

    def checkpoint(self) -> bytes | None:
        import io

        import torch

        buf = io.BytesIO()
        state: dict[str, Any] = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                                 "steps": self.steps_done}
        torch.save(state, buf)
        return buf.getvalue()

    def restore(self, state: bytes) -> None:
        import io

        import torch

        d = torch.load(io.BytesIO(state), weights_only=True)
        self.model.load_state_dict(d["model"])
        self.optimizer.load_state_dict(d["optimizer"])
        self.steps_done = int(d["steps"])
