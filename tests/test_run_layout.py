"""The run layout (shardwise/layout/): one object, built once from the config, cuts every group from
the one rank grid and counts every collective of the run into one ``CommStats``.

The byte checks are exact: the counters add integer byte counts of known shapes, so the all-to-all
bytes of one step are derived by hand from the model's shapes and compared with ``==``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

FP32 = 4


@pytest.mark.parametrize("stage", [1, 3])
def test_sp2_all_to_all_bytes_counted(pool2, stage):
    """Ulysses at SP 2: ``comm_stats()["all_to_all_sequence"]`` of one step equals the formula.

    Each all-to-all is counted as the bytes this rank sends, the whole local tensor: ``b*h*s*d``
    elements for q or for the attention output (``[b, h, s, d]`` sequence-sharded, or ``[b, h/sp,
    sp*s, d]`` head-sharded: the same count), ``b*kv*s*d`` for k or v (``kv``: the kv heads sent,
    copies included). Per attention layer, forward: q, k, v sequence -> heads, the output heads ->
    sequence (``2h + 2kv``). Backward (``sequence_parallel/saved_once.py``, the output kept once):
    q, k, v exchanged again for the recompute, the output's gradient heads <- sequence, and the
    gradients of q, k, v back (``3h + 4kv``). So one micro-batch moves, per rank,
    ``L * b * s * d * (5h + 6kv) * 4`` bytes (fp32), ``s`` = sequence / sp local tokens.
    Tiny model: L 2, b 2, s 8, d 16, h 4, kv 2: 65 536 bytes. The comms logger counts the same.
    """
    for r in pool2.run("layout_cases:sp_step", stage):
        b, s, d, h, kv, layers = (r[k] for k in ("batch", "local_tokens", "head_dim", "heads", "kv_heads", "layers"))
        want = layers * b * s * d * (5 * h + 6 * kv) * FP32
        assert r["sp"] == 2 and r["layout"]["sp"] == 2 and s == 8, r
        assert r["stats"]["all_to_all_sequence"] == want, (r["stats"], want)
        assert r["logged_all_to_all"] == want, (r["logged_all_to_all"], want)
        assert r["stats"]["reduce_scatter"] + r["stats"]["all_reduce"] > 0, r["stats"]  # ZeRO's own, same counter


@pytest.mark.parametrize("stage,use_config", [(2, True), (3, True), (2, False)])
def test_ep2_all_to_all_bytes_counted(pool2, stage, use_config):
    """Expert parallelism at EP 2: ``comm_stats()["all_to_all_ep"]`` of one step, summed over the two
    ranks, equals the formula.

    Per MoE layer, forward: the per-expert counts (``E`` int64, 8 bytes each, the whole ``[ep, E/ep]``
    tensor) go to every rank; the ``T*k`` routed rows of ``H`` values (``T`` tokens of this rank, top
    ``k``) are dispatched, and the ``R`` rows this rank received are sent back by combine. Backward
    reverses both row exchanges on gradients of the same sizes (the integer counts have none). So a
    rank moves ``L * (8E + 2 * (T*k + R) * H * 4)`` bytes; ``R`` depends on the routing, but over the
    EP group the rows received are the rows sent (sum of R = sum of T*k), so the two ranks together
    move ``L * (ep * 8E + 4 * H * 4 * k * sum of T)``. The comms logger counts each rank's own bytes.
    ``use_config`` False: the script split the experts before ``initialize``; the run adopts its groups.
    """
    results = pool2.run("layout_cases:ep_step", stage, use_config)
    r0 = results[0]
    layers, experts, hidden, k, ep = (r0[x] for x in ("layers", "experts", "hidden", "top_k", "ep"))
    tokens = sum(r["tokens"] for r in results)
    want = layers * (ep * 8 * experts + 4 * hidden * FP32 * k * tokens)
    assert sum(r["stats"]["all_to_all_ep"] for r in results) == want, ([r["stats"] for r in results], want)
    for r in results:
        assert r["layout"]["ep"] == 2 and r["layout"]["expert_dp"] == 1, r["layout"]
        assert r["logged_all_to_all"] == r["stats"]["all_to_all_ep"], r
        assert r["stats"]["all_to_all_ep"] >= layers * (8 * experts + 2 * r["tokens"] * k * hidden * FP32), r


def _cfg(extra: dict, world: int):
    from shardwise.config import SupportedFeatures, load_config

    return load_config({"train_micro_batch_size_per_gpu": 1, **extra}, world_size=world,
                       supported=SupportedFeatures.everything())


@pytest.mark.parametrize("extra,world,mpu,match", [
    ({"expert_parallel": {"enabled": True, "autoep_size": 2}, "tensor_parallel": {"autotp_size": 2}}, 4, None,
     r"^expert_parallel.enabled with tensor_parallel.autotp_size > 1 is not supported yet"),
    ({"expert_parallel": {"enabled": True, "autoep_size": 2}, "zero_optimization": {"stage": 3, "mics_shard_size": 2}},
     4, None, r"^expert_parallel.enabled with zero_optimization.mics_shard_size \(hybrid sharding\)"),
    ({"expert_parallel": {"enabled": True, "autoep_size": 2}}, 4, object(), "with a Megatron mpu is not supported"),
    ({"expert_parallel": {"enabled": True, "autoep_size": 3}}, 4, None,
     "^expert_parallel.autoep_size 3 must divide the world size 4"),
    ({"zero_optimization": {"stage": 3, "mics_shard_size": 3}}, 4, None,
     r"^shard group size 3 must divide the data-parallel degree 4 .*\(zero_optimization.mics_shard_size\)$"),
    ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3}}, 8, None,
     r"degree 8 .*\(zero_optimization.zero_hpz_partition_size\)$"),
    ({"tensor_parallel": {"autotp_size": 2}}, 4, object(), "^mpu= and tensor_parallel.autotp_size > 1 both ask"),
])
def test_combinations_refused_in_one_line(extra, world, mpu, match):
    """Every combination the layout cannot serve is refused by the one check, in one line naming the key."""
    from shardwise.errors import UserError
    from shardwise.layout import check_combinations

    with pytest.raises(UserError, match=match) as e:
        check_combinations(_cfg(extra, world), world, mpu)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("extra,world,check,error,match", [
    ({"tensor_parallel": {"autotp_size": 2}}, 4, {"world": 3}, "ConfigError",
     r"^tensor_parallel.autotp_size: 2 does not divide the world size 3; choose a divisor of 3$"),
    ({"sequence_parallel_size": 2, "tensor_parallel": {"autotp_size": 2}}, 4, {"world": 6}, "ConfigError",
     r"^sequence_parallel_size: 2 x tensor_parallel.autotp_size 2 does not divide the world size 6"),
    ({"sequence_parallel_size": 2}, 4, {"mpu": object()}, "UsageError",
     r"^initialize\(mpu=...\) with sequence_parallel_size > 1 is not implemented by shardwise; drop mpu="),
    ({"sequence_parallel_size": 2, "tensor_parallel": {"autotp_size": 2}}, 4, {"sp_from_mpu": True},
     "UsageError", r"^register_with_transformers' sequence parallelism with tensor_parallel.autotp_size > 1"),
])
def test_the_one_check_holds_the_loader_and_initialize_refusals(extra, world, check, error, match):
    """The TP and TP x SP divisibility checks (``load_config``'s before) and the two refusals of groups a
    script cut for SP (``initialize``'s before) are ``check_combinations``'s, with their own exception
    types (``ConfigError``; ``UsageError``, an AssertionError as DeepSpeed asserts) and messages."""
    from shardwise.config import ConfigError
    from shardwise.engine import UsageError
    from shardwise.layout import check_combinations

    cfg = _cfg(extra, world)  # a config the loader accepts at this world, checked again as the run is laid out
    kind = {"ConfigError": ConfigError, "UsageError": UsageError}[error]
    with pytest.raises(kind, match=match) as e:
        check_combinations(cfg, check.get("world", world), check.get("mpu"), check.get("sp_from_mpu", False))
    assert "\n" not in str(e.value) and type(e.value) is kind


def test_load_config_runs_the_one_check_with_the_mpu():
    """``load_config`` runs ``check_combinations`` before its batch rule: a combination the layout would
    refuse is refused once, at load (the launcher loads a train config before starting ranks); given
    ``initialize``'s mpu, it refuses SP beside it and cuts no hpZ group of its own."""
    from shardwise.config import SupportedFeatures, load_config
    from shardwise.engine import UsageError
    from shardwise.errors import UserError

    base = {"train_micro_batch_size_per_gpu": 1}
    with pytest.raises(UserError, match=r"^shard group size 3 must divide the data-parallel degree 4"):
        load_config({**base, "zero_optimization": {"stage": 3, "mics_shard_size": 3}}, world_size=4,
                    supported=SupportedFeatures.everything())
    with pytest.raises(UsageError, match=r"^initialize\(mpu=...\) with sequence_parallel_size > 1"):
        load_config({**base, "sequence_parallel_size": 2}, world_size=2, mpu=object())
    hpz = {**base, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3}}
    assert load_config(hpz, world_size=2, mpu=object(), supported=SupportedFeatures(stage3=True)).dp_world == 2
    with pytest.raises(UserError, match=r"zero_optimization.zero_hpz_partition_size\)$"):
        load_config(hpz, world_size=2, supported=SupportedFeatures(stage3=True))


def test_served_combinations_pass_the_check():
    """What the layout serves is not refused: TP x SP with hybrid sharding and hpZ; EP with SP."""
    from shardwise.layout import check_combinations

    check_combinations(_cfg({"tensor_parallel": {"autotp_size": 2}, "sequence_parallel_size": 2,
                             "zero_optimization": {"stage": 3, "mics_shard_size": 2,
                                                   "zero_hpz_partition_size": 2}}, 8), 8)
    check_combinations(_cfg({"expert_parallel": {"enabled": True, "autoep_size": 4}, "sequence_parallel_size": 2,
                             "zero_optimization": {"stage": 2}}, 8), 8)


def test_one_counter_for_every_group():
    """In a world of one every group is this rank alone, and all of them add to the layout's one counter."""
    from shardwise.layout import RunLayout

    layout = RunLayout.of(ep=1)
    comms = [layout.mesh.dp, layout.mesh.tp, layout.mesh.replicate, layout.mesh.dp_full, layout.expert.ep,
             layout.expert.edp]
    assert all(c.stats is layout.stats for c in comms) and layout.mesh.stats is layout.stats
    assert layout.degrees() == {"world": 1, "dp": 1, "tp": 1, "sp": 1, "ep": 1, "expert_dp": 1, "shard": 1,
                                "replicas": 1, "hpz": 1}


def test_the_old_mesh_path_still_imports():
    """Scripts written against earlier releases import the groups from ``shardwise.mesh``; they get
    the layout's own functions (one implementation), by attribute and by ``from ... import``."""
    import shardwise
    import shardwise.layout as layout
    from shardwise.mesh import ExpertMesh, Mesh, SequenceMesh, get_expert_mesh, get_mesh, get_sequence_mesh

    assert (get_mesh, get_sequence_mesh, get_expert_mesh) == (layout.get_mesh, layout.get_sequence_mesh,
                                                              layout.get_expert_mesh)
    assert (Mesh, SequenceMesh, ExpertMesh) == (layout.Mesh, layout.SequenceMesh, layout.ExpertMesh)
    assert shardwise.mesh.get_mesh is layout.get_mesh


def test_data_parallel_index_is_one_per_sequence_group():
    """``layout.data_parallel(sp)`` (the engine's ``dp_world`` / ``dp_rank`` and ``initialize``'s sampler,
    made before ZeRO shards): world 8, hybrid shard groups of 2 x 2 replicas x TP 1, SP 2. In the rank grid
    (``layout/grid.py``) rank r holds shard rank r % 2 of replica r // 2; every rank of one SP group
    ({0,1}, {2,3}, ...) must read the same sample set, and the 4 groups 4 different ones."""
    from types import SimpleNamespace as NS

    from shardwise.layout import RunLayout

    world, k, sp = 8, 2, 2
    got = {}
    for r in range(world):
        dp = NS(size=k, rank=r % k)  # shard group: k consecutive ranks (TP 1)
        rep = NS(size=world // k, rank=r // k)  # its replicas: the ranks k apart
        layout = RunLayout(NS(dp=dp, replicate=rep), None, None, None)
        got[r] = layout.data_parallel(sp)
    sp_groups = [[g * sp + i for i in range(sp)] for g in range(world // sp)]  # (dp * n + s) * t + tp, t = 1
    assert all(got[r][0] == world // sp for r in got)
    assert [{got[r][1] for r in g} for g in sp_groups] == [{i} for i in range(world // sp)]
