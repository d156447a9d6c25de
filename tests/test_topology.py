"""topology.resolve reads sizes from every config shape; contradictions are startup errors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvtier.config import KVTierConfig
from kvtier.errors import TopologyError
from kvtier.topology import Topology, resolve, validate_lookup_scope


def vllm_config(**parallel: object) -> SimpleNamespace:
    """A VllmConfig-shaped object: sizes only under .parallel_config, as vLLM has them."""
    fields: dict[str, object] = {
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "data_parallel_size": 1,
        "data_parallel_rank": 0,
        "rank": 0,
    }
    fields.update(parallel)
    return SimpleNamespace(
        model_config=SimpleNamespace(model="tiny"), parallel_config=SimpleNamespace(**fields)
    )


# ------------------------------------------------------------------------------ object shapes


def test_vllm_shape_tp4_gives_world_4() -> None:
    topo = resolve(vllm_config(tensor_parallel_size=4))
    assert (topo.tp_size, topo.pp_size, topo.world, topo.rank) == (4, 1, 4, 0)
    assert topo.ranks == (0, 1, 2, 3)


def test_vllm_shape_pp2_tp4_gives_world_8() -> None:
    topo = resolve(vllm_config(tensor_parallel_size=4, pipeline_parallel_size=2, rank=5))
    assert (topo.tp_size, topo.pp_size, topo.world) == (4, 2, 8)
    assert (topo.rank, topo.tp_rank, topo.pp_rank) == (5, 1, 1)


def test_vllm_shape_reads_dp_and_worker_rank() -> None:
    topo = resolve(
        vllm_config(tensor_parallel_size=2, data_parallel_size=4, data_parallel_rank=3, rank=1)
    )
    assert topo == Topology(tp_size=2, pp_size=1, dp_size=4, dp_rank=3, world=2, rank=1)


def test_native_top_level_tp4_not_shadowed_by_rank_only_parallel_config() -> None:
    # ATOM's own config: sizes at the top level, a parallel_config that carries only ranks
    native = SimpleNamespace(
        tensor_parallel_size=4,
        pipeline_parallel_size=1,
        parallel_config=SimpleNamespace(pipeline_parallel_rank=0, rank=3),
    )
    topo = resolve(native)
    assert (topo.world, topo.rank) == (4, 3)


def test_sizes_split_between_levels_combine() -> None:
    # a shim that projects pp to the top level but leaves tp under parallel_config
    shim = SimpleNamespace(
        pipeline_parallel_size=2, parallel_config=SimpleNamespace(tensor_parallel_size=4)
    )
    assert resolve(shim).world == 8


def test_both_present_and_agreeing_is_fine() -> None:
    both = SimpleNamespace(
        tensor_parallel_size=4, parallel_config=vllm_config(tensor_parallel_size=4).parallel_config
    )
    assert resolve(both).world == 4


def test_both_present_and_disagreeing_is_error() -> None:
    both = SimpleNamespace(
        tensor_parallel_size=4, parallel_config=SimpleNamespace(tensor_parallel_size=2)
    )
    with pytest.raises(TopologyError) as err:
        resolve(both)
    msg = str(err.value)
    assert "config.tensor_parallel_size=4" in msg
    assert "config.parallel_config.tensor_parallel_size=2" in msg


def test_rank_disagreeing_between_levels_is_error() -> None:
    both = SimpleNamespace(tensor_parallel_size=4, rank=1, parallel_config=SimpleNamespace(rank=2))
    with pytest.raises(TopologyError, match=r"config.rank=1.*config.parallel_config.rank=2"):
        resolve(both)


def test_nothing_present_is_error_unless_allowed() -> None:
    empty = SimpleNamespace(model="tiny")
    with pytest.raises(TopologyError, match="tensor_parallel_size not found"):
        resolve(empty)
    with pytest.raises(TopologyError, match="tensor_parallel_size not found"):
        resolve({})
    with pytest.raises(TopologyError, match="got None"):
        resolve(None)
    for cfg in (empty, {}, None):
        topo = resolve(cfg, allow_default=True)
        assert (topo.tp_size, topo.pp_size, topo.dp_size, topo.world, topo.rank) == (1, 1, 1, 1, 0)


def test_pp_without_tp_is_error_naming_what_was_seen() -> None:
    with pytest.raises(TopologyError) as err:
        resolve(SimpleNamespace(pipeline_parallel_size=2))
    assert "config.pipeline_parallel_size=2 but no tensor size" in str(err.value)


# --------------------------------------------------------------------------------- dict shapes


def test_dict_top_level_shape() -> None:
    topo = resolve({"tensor_parallel_size": 4, "pipeline_parallel_size": 2, "rank": 7})
    assert (topo.world, topo.rank, topo.tp_rank, topo.pp_rank) == (8, 7, 3, 1)


def test_dict_nested_parallel_config_shape() -> None:
    topo = resolve(
        {
            "parallel_config": {
                "tensor_parallel_size": 4,
                "data_parallel_size": 2,
                "data_parallel_rank": 1,
            }
        }
    )
    assert (topo.world, topo.dp_size, topo.dp_rank) == (4, 2, 1)


def test_dict_rank_only_nested_does_not_shadow_top_level() -> None:
    topo = resolve({"tensor_parallel_size": 4, "parallel_config": {"rank": 2}})
    assert (topo.world, topo.rank) == (4, 2)


def test_dict_disagreement_names_both_keys() -> None:
    cfg = {
        "pipeline_parallel_size": 1,
        "tensor_parallel_size": 2,
        "parallel_config": {"pipeline_parallel_size": 2},
    }
    with pytest.raises(TopologyError) as err:
        resolve(cfg)
    msg = str(err.value)
    assert "config['pipeline_parallel_size']=1" in msg
    assert "config['parallel_config']['pipeline_parallel_size']=2" in msg


def test_dict_nested_object_parallel_config() -> None:
    topo = resolve({"parallel_config": SimpleNamespace(tensor_parallel_size=2, rank=1)})
    assert (topo.world, topo.rank) == (2, 1)


# --------------------------------------------------------------------------- value checks


@pytest.mark.parametrize("bad", [True, 4.0, "4", 0, -2])
def test_sizes_must_be_positive_ints(bad: object) -> None:
    with pytest.raises(TopologyError) as err:
        resolve({"tensor_parallel_size": bad})
    assert "tensor_parallel_size" in str(err.value)
    assert repr(bad) in str(err.value) or str(bad) in str(err.value)


def test_none_size_counts_as_absent() -> None:
    cfg = {"tensor_parallel_size": None, "parallel_config": {"tensor_parallel_size": 2}}
    assert resolve(cfg).world == 2


def test_explicit_rank_overrides_config_rank() -> None:
    topo = resolve(vllm_config(tensor_parallel_size=4, rank=0), rank=3)
    assert (topo.rank, topo.tp_rank) == (3, 3)


@pytest.mark.parametrize("rank", [4, -1])
def test_rank_outside_world_is_error(rank: int) -> None:
    with pytest.raises(TopologyError) as err:
        resolve(vllm_config(tensor_parallel_size=4), rank=rank)
    assert f"rank argument={rank} is outside [0, 4)" in str(err.value)


def test_config_rank_outside_world_is_error() -> None:
    with pytest.raises(TopologyError, match=r"parallel_config.rank=4 is outside \[0, 2\)"):
        resolve(vllm_config(tensor_parallel_size=2, rank=4))


def test_bool_rank_argument_is_error() -> None:
    with pytest.raises(TopologyError, match="rank=True is not an int"):
        resolve({"tensor_parallel_size": 2}, rank=True)


def test_dp_rank_outside_dp_size_is_error() -> None:
    with pytest.raises(TopologyError, match=r"data_parallel_rank'\]=2 is outside \[0, 2\)"):
        resolve({"tensor_parallel_size": 1, "data_parallel_size": 2, "data_parallel_rank": 2})


def test_context_parallelism_is_rejected_not_miscounted() -> None:
    cfg = vllm_config(tensor_parallel_size=2, prefill_context_parallel_size=2)
    with pytest.raises(TopologyError, match="prefill_context_parallel_size=2"):
        resolve(cfg)
    assert resolve(vllm_config(tensor_parallel_size=2, prefill_context_parallel_size=1)).world == 2


def test_decode_context_parallelism_is_refused_naming_the_setting() -> None:
    """DCP shards a block's tokens across the TP ranks with the same tensor shapes as without
    it: an engine with it and one without would read each other's blocks from a shared tier,
    and an MLA model would be taken for replicated (rank 1 restoring rank 0's shard)."""
    cfg = vllm_config(tensor_parallel_size=2, decode_context_parallel_size=2)
    with pytest.raises(TopologyError, match="decode_context_parallel_size=2"):
        resolve(cfg)
    assert resolve(vllm_config(tensor_parallel_size=2, decode_context_parallel_size=1)).world == 2


def test_topology_passthrough_and_with_rank() -> None:
    topo = resolve({"tensor_parallel_size": 4})
    assert resolve(topo) is topo
    assert resolve(topo, rank=2).rank == 2
    with pytest.raises(TopologyError, match="outside"):
        topo.with_rank(4)


def test_topology_rejects_inconsistent_world() -> None:
    with pytest.raises(TopologyError, match="world=3"):
        Topology(tp_size=2, pp_size=1, dp_size=1, dp_rank=0, world=3, rank=0)


def test_describe_names_world_and_origin() -> None:
    topo = resolve(vllm_config(tensor_parallel_size=4, rank=2))
    assert topo.describe() == "world=4 from tp=4 x pp=1, rank 2, dp 0/1"


# ------------------------------------------------------------------------------ lookup scope


def test_lookup_scope_none_means_every_rank() -> None:
    topo = resolve(vllm_config(tensor_parallel_size=4))
    assert validate_lookup_scope(None, topo) == (0, 1, 2, 3)


def test_lookup_scope_inside_world_is_kept_in_order() -> None:
    topo = resolve(vllm_config(tensor_parallel_size=4))
    assert validate_lookup_scope([3, 0], topo) == (3, 0)


def test_lookup_scope_outside_world_is_startup_error() -> None:
    # the seed: a TP4 vLLM config read at the top level only collapses to world 1
    vllm = vllm_config(tensor_parallel_size=4)
    wrong = resolve({"tensor_parallel_size": getattr(vllm, "tensor_parallel_size", 1)})
    assert wrong.world == 1
    scope = KVTierConfig.from_dict({"lookup_scope": "0,1,2,3"}).lookup_scope
    with pytest.raises(TopologyError) as err:
        validate_lookup_scope(scope, wrong)
    assert str(err.value).startswith(
        "lookup_scope (0, 1, 2, 3) names ranks [1, 2, 3] outside [0, 1) (world=1 from tp=1 x pp=1)"
    )
    # the right reading of the same config accepts the same scope
    assert validate_lookup_scope(scope, resolve(vllm)) == (0, 1, 2, 3)


def test_lookup_scope_error_matches_documented_shape() -> None:
    topo = resolve({"tensor_parallel_size": 2})
    with pytest.raises(TopologyError) as err:
        validate_lookup_scope((0, 1, 2, 3), topo)
    msg = str(err.value)
    assert msg.startswith(
        "lookup_scope (0, 1, 2, 3) names ranks [2, 3] outside [0, 2) (world=2 from tp=2 x pp=1); "
    )
    assert "leave lookup_scope unset" in msg


@pytest.mark.parametrize(
    ("scope", "needle"),
    [
        ((), "is empty"),
        ((0, 0, 1), "names ranks [0] more than once"),
        ((0, -1), "names ranks [-1] outside [0, 4)"),
        ((0, True), "non-int ids [True]"),
        ("0,1", "is a string"),
    ],
)
def test_lookup_scope_bad_ids_are_errors(scope: object, needle: str) -> None:
    topo = resolve({"tensor_parallel_size": 4})
    with pytest.raises(TopologyError) as err:
        validate_lookup_scope(scope, topo)  # type: ignore[arg-type]
    assert needle in str(err.value)
