"""One identity per harvested GPU (``bubbles.core.identity.GpuKey``): what it accepts, how it is written and read
back, and the rank a process of DeepSpeed's grid gets within its stage."""

from __future__ import annotations

import pytest

from bubbles.core import paths
from bubbles.core.identity import LOCAL_NAMESPACE, MAX_RANKS, MAX_STAGES, GpuKey, check_namespace, stage_rank


def test_a_key_is_written_as_its_directory_and_read_back() -> None:
    key = GpuKey("ml-team", "llama.v2", 3, 5)
    assert str(key) == "ml-team/llama.v2/stage-3/rank-5" == paths.gpu_relpath(key)
    assert GpuKey.parse(str(key)) == key
    assert GpuKey("ml", "t", 0) == GpuKey("ml", "t", 0, 0)  # rank 0 unless said: a stage of one rank
    local = GpuKey(LOCAL_NAMESPACE, "t", 1, 0)
    assert local.local and not key.local
    assert GpuKey.parse(str(local)) == local
    assert key.stage_key == ("ml-team", "llama.v2", 3) and key.training_key == ("ml-team", "llama.v2")
    # The ranks of one stage share its stage key and sort by rank: one slowdown guard, one schedule per stage.
    ranks = [GpuKey("ml", "t", 1, r) for r in (2, 0, 1)]
    assert {k.stage_key for k in ranks} == {("ml", "t", 1)}
    assert sorted(ranks) == [GpuKey("ml", "t", 1, r) for r in (0, 1, 2)]


@pytest.mark.parametrize(("args", "message"), [
    (("Team_A", "t", 0, 0), "namespace 'Team_A' is not valid: use a Kubernetes namespace name"),
    (("", "t", 0, 0), "namespace '' is not valid"),
    (("ml.team", "t", 0, 0), "namespace 'ml.team' is not valid"),  # a DNS label: no dots
    (("_attach", "t", 0, 0), "namespace '_attach' is not valid"),  # the fill Pods' mount is no namespace
    (("-ml", "t", 0, 0), "namespace '-ml' is not valid"),
    (("a" * 64, "t", 0, 0), "is not valid"),
    (("ml", "Llama", 0, 0), "training name 'Llama' is not valid: use 1-63 lower-case letters"),
    (("ml", "", 0, 0), "training name '' is not valid"),
    (("ml", "../x", 0, 0), "training name '../x' is not valid"),
    (("ml", "t", -1, 0), f"stage -1 is not valid: use an integer from 0 to {MAX_STAGES - 1}"),
    (("ml", "t", MAX_STAGES, 0), f"stage {MAX_STAGES} is not valid"),
    (("ml", "t", True, 0), "stage True is not valid"),
    (("ml", "t", "1", 0), "stage '1' is not valid"),
    (("ml", "t", 0, -1), f"rank -1 is not valid: use an integer from 0 to {MAX_RANKS - 1}"),
    (("ml", "t", 0, MAX_RANKS), f"rank {MAX_RANKS} is not valid"),
    (("ml", "t", 0, 1.0), "rank 1.0 is not valid"),
    (("ml", "t", 0, False), "rank False is not valid"),
])
def test_a_key_that_names_no_gpu_is_refused_saying_what_to_use(args: tuple[object, ...], message: str) -> None:
    with pytest.raises(ValueError) as exc:
        GpuKey(*args)  # type: ignore[arg-type]
    assert message in str(exc.value), str(exc.value)


def test_the_local_namespace_is_none_kubernetes_could_name() -> None:
    assert check_namespace(LOCAL_NAMESPACE) == "_local"
    assert check_namespace("default") == "default"
    with pytest.raises(ValueError, match="or '_local' for a training outside Kubernetes"):
        check_namespace("_other")


@pytest.mark.parametrize("text", [
    "ml/t/stage-0", "ml/t/stage-0/rank-", "ml/t/stage-x/rank-0", "/t/stage-0/rank-0", "ml/t/stage-0/rank-0/",
    "t/stage-0/rank-0", "ml/t/sub/stage-0/rank-0", "",
])
def test_a_key_written_otherwise_is_refused_with_its_form(text: str) -> None:
    with pytest.raises(ValueError, match="is not a GPU key: write <namespace>/<training>/stage-<k>/rank-<r>"):
        GpuKey.parse(text)


def test_a_parsed_key_is_validated_as_a_built_one() -> None:
    with pytest.raises(ValueError, match="namespace 'ML' is not valid"):
        GpuKey.parse("ML/t/stage-0/rank-0")
    with pytest.raises(ValueError, match="rank 4096 is not valid"):
        GpuKey.parse("ml/t/stage-0/rank-4096")


@pytest.mark.parametrize(("dp_rank", "mp_rank", "mp_size", "rank"), [
    (0, 0, 1, 0),  # a stage of one rank
    (1, 0, 1, 1), (3, 0, 1, 3),  # data-parallel replicas
    (0, 1, 2, 1), (0, 3, 4, 3),  # tensor-parallel ranks
    (1, 0, 2, 2), (1, 1, 2, 3), (2, 3, 4, 11),  # both: data-parallel rank x model-parallel size + model-parallel rank
])
def test_a_stage_rank_is_its_place_in_the_data_and_model_parallel_grid(dp_rank: int, mp_rank: int, mp_size: int,
                                                                       rank: int) -> None:
    assert stage_rank(dp_rank, mp_rank, mp_size) == rank


@pytest.mark.parametrize(("dp_rank", "mp_rank", "mp_size"), [(0, 0, 0), (0, 2, 2), (0, -1, 2), (-1, 0, 1)])
def test_a_place_outside_the_grid_is_refused(dp_rank: int, mp_rank: int, mp_size: int) -> None:
    with pytest.raises(ValueError, match="not a place in a grid"):
        stage_rank(dp_rank, mp_rank, mp_size)
