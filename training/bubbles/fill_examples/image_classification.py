"""Fill job: train a CNN on synthetic 32x32 images (CIFAR-sized), one optimizer step per step().

Two sizes: ``arch="small"`` (default), a two-convolution CNN sized to ~1 ms a step on one CPU core, and
``arch="resnet"``, a ResNet-18 layout (four stages of two basic blocks, ``width`` channels doubling per
stage) for GPUs: at ``batch_size`` 64, ``width`` 64 and ``dtype="bfloat16"`` a step is a few milliseconds
of a large GPU, short enough for the program-directed limit to fit it into pipeline bubbles.
"""

from __future__ import annotations

from typing import Any

from bubbles.fill_examples._counted import FlopCountedJob, check_cuda_graphs, check_dtype, parse_step_sizes

ARCHS = ("small", "resnet")


class ImageClassification(FlopCountedJob):
    """A CNN trained with SGD on random images and labels.

    ``arch``, ``batch_size`` and ``width`` (channels of the first convolution) set the step time; ``dtype``
    the precision (``"float32"`` or ``"bfloat16"``); ``steps`` (optional) makes the job finish after that many
    batches; ``step_sizes`` the part-batches a step may train on where a whole one does not fit (default a
    quarter, a half and the whole batch; ``[]``: whole batches only). The job runs on the device the agent
    assigned (``bubbles.sdk.assigned_device()``).

    ``cuda_graphs`` (CUDA only): each step size's whole training step (forward, loss, backward, SGD update) is
    captured once as a CUDA graph at init, as PyTorch's CUDA graphs notes show for a whole network, and replayed
    by every step: one launch in place of one per kernel (on an H100 the eager steps were launch-bound, 12.6 ms
    for 16, 32 and 64 images under contexts; docs/gpu.md). Capturing runs 3 warm-up steps per size at init, not
    counted as fill work. Not yet run on a GPU.
    """

    def __init__(self, batch_size: int = 4, width: int = 8, classes: int = 10, steps: int | None = None,
                 seed: int = 0, arch: str = "small", dtype: str = "float32",
                 step_sizes: list[int] | None = None, cuda_graphs: bool = False) -> None:
        if batch_size < 1 or width < 1 or classes < 2:
            raise ValueError("batch_size and width must be >= 1 and classes >= 2")
        if arch not in ARCHS:
            raise ValueError(f"arch must be one of {', '.join(repr(a) for a in ARCHS)}, got {arch!r}; "
                             "'small' for CPUs, 'resnet' for GPUs")
        self.batch_size = batch_size
        self.width = width
        self.classes = classes
        self.max_steps = steps
        self.seed = seed
        self.arch = arch
        self.dtype = check_dtype(dtype)
        self.step_sizes = parse_step_sizes(step_sizes, batch_size)
        self.cuda_graphs = check_cuda_graphs(cuda_graphs)
        self.graphs = {}  # size -> (graph, (static images, labels), static loss)
        self.steps_done = 0
        self.step_flops: float | None = None
        self.last_loss = float("nan")

    def create(self) -> None:
        import torch
        from torch import nn

        g = torch.Generator().manual_seed(self.seed)
        torch.manual_seed(self.seed)
        self.model = _resnet18(self.width, self.classes) if self.arch == "resnet" else _small_cnn(self.width,
                                                                                                   self.classes)
        # The ResNet preset is for GPUs, whose convolution kernels run fastest on channels-last (NHWC) tensors;
        # it uses that layout on every device, so that the CPU tests run the GPU's code path.
        self.channels_last = self.arch == "resnet"
        layout = torch.channels_last if self.channels_last else torch.contiguous_format
        self.model.to(dtype=self.torch_dtype(), memory_format=layout)
        # A few fixed batches cycled through: data loading is not what this example measures.
        self.images = [torch.randn(self.batch_size, 3, 32, 32, generator=g).to(self.torch_dtype())
                       .contiguous(memory_format=layout) for _ in range(4)]
        self.labels = torch.randint(0, self.classes, (4, self.batch_size), generator=g)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.loss_fn = nn.CrossEntropyLoss()
        self.device = "cpu"

    def init(self) -> None:
        import torch

        device = self.target_device()
        self._require_cuda_for_graphs(device)
        if device != "cpu":
            self.device = device
            # Module.to keeps the parameters (and their layout); the optimizer's state, created on the first step
            # or restored from a checkpoint on the CPU before init(), follows them.
            self.model.to(device)
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if torch.is_tensor(value):
                        state[key] = value.to(device)
            self.images = [img.to(device) for img in self.images]  # .to keeps the channels-last strides
            self.labels = self.labels.to(device)
        self._count_first_step()  # outside the bubbles: see the package doc (eager: the FLOP counter sees it)
        if self.cuda_graphs:
            # the whole step, zero_grad(set_to_none) included: each graph's backward writes gradients of its own
            # (its memory pool), and its update reads them; parameters and momentum are shared by all sizes
            self._capture_graphs(lambda size: (self.images[0][:size].clone(), self.labels[0][:size].clone()),
                                 self._train_on)

    def _train_on(self, images: Any, labels: Any) -> Any:
        """One SGD step on a batch; the loss (a tensor on the device)."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(images).float(), labels)
        loss.backward()  # counted: training FLOPs are forward + backward
        self.optimizer.step()
        return loss

    def _work(self, size: int) -> None:
        import torch

        i = self.steps_done % len(self.images)
        loss = self._replay(size, (self.images[i][:size], self.labels[i][:size]))
        if loss is not None:
            self.last_loss = float(loss.detach())
            return
        # On CPU the ResNet preset runs without oneDNN: torch 2.13.0's oneDNN kernel for the backward pass of a
        # channels-last 1x1 convolution (jit_avx2_1x1_convolution_bwd_weights) crashes the process with one
        # thread on AMD EPYC. The preset is for GPUs; on CPU it only has to run correctly.
        with torch.backends.mkldnn.flags(enabled=not (self.channels_last and self.device == "cpu")):
            loss = self._train_on(self.images[i][:size], self.labels[i][:size])
            self.last_loss = float(loss.detach())

    def checkpoint(self) -> bytes | None:
        import io

        import torch

        buf = io.BytesIO()
        state: dict[str, Any] = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                                 "steps": self.steps_done, "samples": self.samples_done}
        torch.save(state, buf)
        return buf.getvalue()

    def restore(self, state: bytes) -> None:
        import io

        import torch

        if self.graphs:  # the graphs hold the optimizer's momentum tensors, which loading would replace
            raise RuntimeError("restore() after the CUDA graphs were captured (init()) would leave them updating the "
                               "old optimizer state; restore before init(), as the fill runtime does")

        # On the CPU: the tensors were saved from the GPU the last attempt ran on, and loading them there would make a
        # CUDA context before init(), on a device this attempt may not have been given (the runtime refuses that).
        d = torch.load(io.BytesIO(state), weights_only=True, map_location="cpu")
        self.model.load_state_dict(d["model"])
        self.optimizer.load_state_dict(d["optimizer"])
        self.steps_done = int(d["steps"])
        self.samples_done = int(d.get("samples", self.steps_done * self.batch_size))


def _small_cnn(w: int, classes: int) -> Any:
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(3, w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 16x16
        nn.Conv2d(w, 2 * w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(4),  # 4x4
        nn.Flatten(), nn.Linear(2 * w * 16, classes),
    )


def _resnet18(w: int, classes: int) -> Any:
    """ResNet-18 for 32x32 inputs (a 3x3 stem, no max-pool), as in the usual CIFAR variants."""
    import torch
    from torch import nn

    class BasicBlock(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.short = nn.Sequential()
            if stride != 1 or cin != cout:
                self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(self.bn2(self.conv2(y)) + self.short(x))

    layers: list[nn.Module] = [nn.Conv2d(3, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU()]
    cin = w
    for i, cout in enumerate((w, 2 * w, 4 * w, 8 * w)):
        for j in range(2):
            layers.append(BasicBlock(cin, cout, 2 if (i > 0 and j == 0) else 1))
            cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)
