"""The one-GPU harvesting benchmark (gpubench): the fill examples it runs, on their assigned device, in their
precision, with their GPU presets, FLOP counts and CUDA graphs (replay through a stand-in here; the real graphs on
a GPU, marked ``gpu``)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.gpubench import one_thread

__all__ = ["one_thread"]  # the autouse fixture, from helpers.gpubench

# ---------------------------------------------------------------------------------------------------
# the fill examples: assigned device, precision, GPU presets, FLOP counts


def test_fill_examples_validate_dtype_and_architecture() -> None:
    from bubbles.fill_examples.batch_inference import BatchInference
    from bubbles.fill_examples.image_classification import ImageClassification

    with pytest.raises(ValueError, match="dtype must be one of 'float32', 'bfloat16', got 'fp16'"):
        ImageClassification(dtype="fp16")
    with pytest.raises(ValueError, match="arch must be one of"):
        ImageClassification(arch="vgg")
    with pytest.raises(ValueError, match="dtype must be one of"):
        BatchInference(dtype="half")
    with pytest.raises(ValueError, match="multiple of heads"):
        BatchInference(width=770, heads=12)
    with pytest.raises(ValueError, match="ffn"):
        BatchInference(ffn=0)


def test_fill_examples_go_where_the_agent_assigned_them(monkeypatch: pytest.MonkeyPatch) -> None:
    from bubbles.fill_examples.image_classification import ImageClassification

    monkeypatch.setenv("BUBBLES_DEVICE", "cpu:1")  # a CPU executor: core 1 stands in for the accelerator
    job = ImageClassification(steps=2)
    job.create()
    job.init()
    assert job.device == "cpu"
    # The agent's assignment is followed, not torch.cuda.is_available(): where this build of torch has no CUDA,
    # following it fails loudly instead of silently training on the CPU.
    monkeypatch.setenv("BUBBLES_DEVICE", "cuda:0")
    job = ImageClassification(steps=2)
    job.create()
    if torch.cuda.is_available():
        job.init()
        assert job.device == "cuda:0"
    else:
        with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
            job.init()


def test_bert_shaped_inference_counts_the_flops_of_its_shape() -> None:
    from bubbles.fill_examples.batch_inference import BatchInference

    args = BatchInference.bert_base(batch_size=2, layers=2, seq_len=16, dtype="float32")
    job = BatchInference(**args, steps=2)
    job.create()
    job.init()
    b, s, w, f, n = 2, 16, 768, 3072, 2
    matmuls = 2 * b * s * n * (4 * w * w + 2 * w * f)
    attention = 2 * 2 * b * s * s * w * n
    head = 2 * b * w * 10
    assert job.step_flops == pytest.approx(matmuls + attention + head, rel=0.01)
    assert job.step().samples == 2


def test_cuda_graphs_are_refused_with_a_clear_error_where_there_is_no_cuda_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from bubbles.fill_examples.batch_inference import BatchInference
    from bubbles.fill_examples.image_classification import ImageClassification

    monkeypatch.setenv("BUBBLES_DEVICE", "cpu:0")
    for cls in (BatchInference, ImageClassification):
        with pytest.raises(ValueError, match="cuda_graphs must be true or false, got 'yes'"):
            cls(cuda_graphs="yes")  # type: ignore[arg-type]
        job = cls(cuda_graphs=True, steps=1)
        job.create()
        with pytest.raises(RuntimeError, match=r"cuda_graphs needs a CUDA device.*'cpu'.*set cuda_graphs to false"):
            job.init()
        assert not job.graphs
        assert job.steps_done == 0  # nothing captured, nothing run
    plain = BatchInference(steps=1)  # the default: eager steps, no graphs
    plain.create()
    plain.init()
    assert plain.step(plain.batch_size).samples == plain.batch_size
    assert not plain.graphs


def test_a_replayed_step_copies_its_batch_into_the_graphs_inputs_and_reads_its_output() -> None:
    # The replay plumbing, with a stand-in for torch.cuda.CUDAGraph (no GPU here): the step's batch goes into the
    # captured size's static inputs, in order, before the replay, and the step reports the graph's output.
    from bubbles.fill_examples.image_classification import ImageClassification

    job = ImageClassification(batch_size=4, steps=4)
    job.create()
    job.init()  # eager on CPU: no graphs

    class StandInGraph:
        def __init__(self, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            self.inputs, self.output, self.seen = inputs, output, []

        def replay(self) -> None:
            images, labels = self.inputs
            self.seen.append((images.clone(), labels.clone()))
            self.output.fill_(float(labels.sum()))

    inputs = (torch.zeros_like(job.images[0][:2]), torch.zeros_like(job.labels[0][:2]))
    graph = StandInGraph(inputs, torch.zeros(()))
    job.graphs[2] = (graph, inputs, graph.output)
    weights = [p.detach().clone() for p in job.model.parameters()]
    i = job.steps_done % len(job.images)
    job.step(2)
    assert len(graph.seen) == 1
    assert torch.equal(graph.seen[0][0], job.images[i][:2])
    assert torch.equal(graph.seen[0][1], job.labels[i][:2])
    assert job.last_loss == float(job.labels[i][:2].sum())
    assert all(torch.equal(a, p) for a, p in zip(weights, job.model.parameters(), strict=True))  # no eager step
    job.step(4)  # no graph for a whole batch: the eager step
    assert len(graph.seen) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_on_a_gpu_graph_replayed_inference_steps_compute_what_eager_ones_do(monkeypatch: pytest.MonkeyPatch) -> None:
    from bubbles.fill_examples.batch_inference import BatchInference

    monkeypatch.setenv("BUBBLES_DEVICE", "cuda:0")
    args = BatchInference.bert_base(batch_size=8, layers=2, seq_len=32, dtype="float32")
    job = BatchInference(**args, cuda_graphs=True)
    job.create()
    job.init()
    assert set(job.graphs) == {2, 4, 8}  # a quarter, a half and the whole batch
    for size in (2, 4, 8):
        before = job.steps_done
        result = job.step(size)
        assert result.samples == size
        assert result.flops == job.flops_by_size[size] > 0
        _graph, (static,), logits = job.graphs[size]
        with torch.no_grad():
            eager = job._forward(static.clone())
        torch.testing.assert_close(logits, eager, rtol=1e-4, atol=1e-4)
        assert job.steps_done == before + 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_on_a_gpu_graph_replayed_training_steps_update_the_model_as_eager_ones_do(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from bubbles.fill_examples.image_classification import ImageClassification

    monkeypatch.setenv("BUBBLES_DEVICE", "cuda:0")
    graphed = ImageClassification(arch="resnet", batch_size=8, width=8, cuda_graphs=True)
    graphed.create()
    graphed.init()
    assert set(graphed.graphs) == {2, 4, 8}
    eager = ImageClassification(arch="resnet", batch_size=8, width=8)
    eager.create()
    eager.init()
    # the same state (capturing ran warm-up steps) and the same batch next, then one step of each size on both
    eager.restore(graphed.checkpoint())  # a copy (optimizer.load_state_dict alone would share the momentum tensors)
    eager.steps_done = graphed.steps_done
    for size in (2, 4, 8):
        g, e = graphed.step(size), eager.step(size)
        assert g.samples == e.samples == size
        assert g.flops == e.flops > 0
        assert graphed.last_loss == pytest.approx(eager.last_loss, rel=1e-3)
    for (name, a), (_, b) in zip(graphed.model.state_dict().items(), eager.model.state_dict().items(), strict=True):
        if a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4, msg=name)


def test_a_checkpointed_image_job_restores_onto_its_device(monkeypatch: pytest.MonkeyPatch) -> None:
    # The runtime restores a checkpoint after create(), before init() moves the job to its device: the optimizer's
    # momentum must follow the parameters there (on a GPU a CPU momentum buffer would stop the first step).
    from bubbles.fill_examples.image_classification import ImageClassification

    monkeypatch.setenv("BUBBLES_DEVICE", "cuda:0" if torch.cuda.is_available() else "cpu:0")
    first = ImageClassification(steps=4)
    first.create()
    first.init()
    first.step()
    state = first.checkpoint()
    assert state is not None
    again = ImageClassification(steps=4)
    again.create()
    again.restore(state)
    again.init()
    again.step()
    devices = {p.device for p in again.model.parameters()}
    momentum = {st["momentum_buffer"].device for st in again.optimizer.state.values()}
    assert momentum == devices
    assert again.steps_done >= 2
    again.graphs[1] = (None, (), None)  # as after capturing: the graphs hold the momentum tensors
    with pytest.raises(RuntimeError, match=r"restore\(\) after the CUDA graphs.*restore before init"):
        again.restore(state)


def test_resnet_preset_trains_in_bf16_and_its_flops_scale_with_the_batch() -> None:
    from bubbles.fill_examples.image_classification import ImageClassification

    flops = {}
    for batch, dtype in ((2, "bfloat16"), (4, "bfloat16"), (2, "float32")):
        job = ImageClassification(arch="resnet", width=4, batch_size=batch, dtype=dtype, steps=2)
        job.create()
        job.init()
        result = job.step()
        assert result.samples == batch
        assert math.isfinite(job.last_loss)
        # the GPU preset's layout (tensor-core convolutions), on every device
        assert all(img.is_contiguous(memory_format=torch.channels_last) for img in job.images)
        flops[(batch, dtype)] = result.flops
    assert flops[(4, "bfloat16")] == pytest.approx(2 * flops[(2, "bfloat16")], rel=0.01)
    assert flops[(2, "float32")] == flops[(2, "bfloat16")]  # FLOPs do not depend on the precision
    small = ImageClassification(batch_size=2, width=4)
    small.create()
    small.init()
    assert (small.step_flops or 0) < flops[(2, "float32")]
