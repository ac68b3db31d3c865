"""DeepSpeed's public API as scripts written for DeepSpeed call it (issue 10 items 4, 5, 6, 8).

Each test states the DeepSpeed behaviour it holds shardwise to; numbers are compared with plain
single-process torch (see ds_api_cases.py).
"""

from __future__ import annotations

import argparse
import inspect

import pytest
import torch
from ds_api_cases import SimpleModel
from rank_pool import RankError

import shardwise
from shardwise.utils.zero_to_fp32 import (
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)

TOL = 1e-5
STAGES = [0, 1, 2, 3]


def test_initialize_has_deepspeeds_signature():
    names = list(inspect.signature(shardwise.initialize).parameters)
    assert names == ["args", "model", "optimizer", "model_parameters", "training_data", "lr_scheduler",
                     "distributed_port", "mpu", "dist_init_required", "collate_fn", "config", "mesh_param",
                     "config_params"]


def test_add_config_arguments():
    parser = shardwise.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert args.deepspeed is True and args.deepspeed_config == "ds.json"
    assert parser.parse_args([]).deepspeed is False and parser.parse_args([]).deepscale_config is None


@pytest.mark.parametrize("stage", [0, 3])
def test_engine_without_optimizer_evaluates(pool2, stage, tmp_path):
    """DeepSpeed: no optimizer anywhere gives an evaluation engine (optimizer None); backward and
    step assert "must provide optimizer"; module state saves and loads."""
    res = pool2.run("ds_api_cases:no_optimizer", stage, str(tmp_path))
    for r in res:
        assert r["opt"] is None and r["sched"] is None
        assert r["forward_diff"] < TOL
        assert len(r["errors"]) == 2 and all("must provide optimizer" in e for e in r["errors"])
        assert r["before"] > 1e-3 and r["after"] < TOL


def test_engine_without_optimizer_zero_init_offload_bf16(pool2):
    for r in pool2.run("ds_api_cases:no_optimizer_offload_bf16"):
        assert r["opt"] is None and r["finite"] and r["dtype"] == "torch.bfloat16"


def test_engine_without_optimizer_generates(pool2):
    assert pool2.run("ds_api_cases:generate_without_optimizer", 3) == [True, True]


@pytest.mark.parametrize("stage", [0, 2])
def test_client_optimizer_overrides_config_optimizer(pool2, stage):
    """DeepSpeed: a client optimizer "overrides any optimizer definition in the json config", and
    initialize returns that very optimizer object (as at ZeRO stage 0 in DeepSpeed)."""
    res = pool2.run("ds_api_cases:optimizer_rules", "override", stage)
    for r in res:
        assert r["is_client"] and r["engine_opt"] and r["type"] == "AdamW"
        assert r["diff"] < TOL


def test_client_optimizer_on_zero_init_parameters(pool2):
    assert all(d < TOL for d in pool2.run("ds_api_cases:zero_init_client_optimizer"))


def test_client_optimizer_empty_param_group_dropped(pool2):
    """DeepSpeed removes param groups without parameters from the client optimizer."""
    res = pool2.run("ds_api_cases:optimizer_rules", "empty_group", 1)
    assert all(r["is_client"] and r["groups"] == 1 and r["diff"] < TOL for r in res)


@pytest.mark.parametrize("stage", [1, 3])
def test_optimizer_factory_gets_model_parameter_groups(pool2, stage):
    """DeepSpeed calls a callable optimizer with model_parameters (group hyperparameters kept)."""
    res = pool2.run("ds_api_cases:optimizer_rules", "callable", stage)
    for r in res:
        assert r["type"] == "AdamW" and r["wd"] == [0.1, 0.0] and r["diff"] < TOL


@pytest.mark.parametrize("stage", [0, 2])
def test_returned_optimizer_param_groups_state_dict_zero_grad(pool2, stage):
    res = pool2.run("ds_api_cases:returned_optimizer_api", stage)
    for r in res:
        assert r["state_keys"] == ["param_groups", "state"] and r["n_state"] > 0
        assert r["moved"] == 0.0 and r["lr"] == [0.0]  # lr set through the returned optimizer took effect
        assert "call engine.step()" in r["direct_step"]  # never a silent no-op step


def test_scheduler_built_on_another_optimizer_refused(pool2):
    """DeepSpeed asserts when a scheduler object does not belong to the engine's optimizer."""
    assert all("another optimizer" in r for r in pool2.run("ds_api_cases:scheduler_on_other_optimizer"))


def test_args_deepspeed_config_and_positional_order(pool2, tmp_path):
    res = pool2.run("ds_api_cases:args_config", str(tmp_path))
    for r in res:
        assert r["stage"] == 1 and r["opt"] == "AdamW"
        assert "both" in r["errors"][0] and "needs a config" in r["errors"][1]


def test_mpu_without_megatron_methods_or_wrong_sizes_refused(pool2):
    for errors in pool2.run("ds_api_cases:mpu_checks"):
        assert "lacks get_model_parallel_rank" in errors[0]
        assert "1 x data-parallel size 1 != world size 2" in errors[1]


def test_engine_accessors_destroy_and_partition_cache(pool2):
    r = pool2.run("ds_api_cases:accessors")[0]
    assert r["bf16"] == (True, False) and r["fp16"] == (False, True)
    assert r["zero"] and r["clip"] == 0.5 and r["dp"] == 2 and r["partition_weights"]
    assert r["steps"] == 2 and r["samples"] == 2 * 2 * 2 and r["lr"] == [pytest.approx(1e-2)]
    assert r["evaluating"] and r["training"] and r["boundary"] and r["loss_scale"] == 0.0
    assert not any(r["gathered"])  # empty_partition_cache released every stage-3 unit
    assert r["hooks_left"] == 0 and r["passthrough"]  # model attributes reachable on the engine
    assert r["dp_group"] is None  # the world group, as torch names it


@pytest.mark.parametrize("stage", [0, 2])
def test_set_gradient_accumulation_boundary(pool2, stage):
    assert all(d == 0.0 for d in pool2.run("ds_api_cases:manual_boundary", stage))


def test_comm_facade(pool2):
    res = pool2.run("ds_api_cases:comm_facade")
    for r in res:
        assert r["world"] == 2 and r["local"] == r["rank"] and r["init"]
        assert r["sum"] == 3.0 and r["bcast"] == 1.0 and r["gather"] == [0.0, 10.0]
        assert r["into"] == [0.5, 1.5] and r["max"] == 1.0
        assert r["rs"] == 2 * r["rank"] + 1  # element rank of arange(2) + 0 plus arange(2) + 1
    assert shardwise.comm.Comm is not None  # the internal layer is still there


@pytest.mark.parametrize("stage", STAGES)
def test_safe_get_set_accessors_match_plain_torch(pool2, stage):
    """safe_get_full_* equal plain torch's param, grad and Adam state; local pieces tile the full
    value; the setters write what the getters read back."""
    res = pool2.run("ds_api_cases:safe_accessors", stage)
    for r in res:
        for k in ("param", "grad", "exp_avg", "exp_avg_sq"):
            assert r[k] < 1e-5, (k, r[k])
        assert r["set_full"] == 0.0 and r["visible"] == 0.0 and r["set_local"] < 1e-7
        assert r["set_state"] == 0.0 and r["set_grad"] == 0.0
    # every rank's local piece, in rank order, tiles the full value (at stage 0 a piece is all of it)
    for name, got in res[0]["local"].items():
        for i in range(3):
            whole = got["full"][i]
            tiled = got["pieces"][i] if stage == 0 else torch.cat([res[r]["local"][name]["pieces"][i]
                                                                  for r in range(2)])
            assert torch.equal(tiled, whole), (name, i)


def test_safe_full_grad_removes_fp16_loss_scale(pool2):
    r = pool2.run("ds_api_cases:safe_accessors", 2, "fp16")[0]
    assert r["grad"] < 5e-3  # fp16 compute: the grad is the true one, not times the loss scale (16)


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_to_fp32_offline(pool2, stage, tmp_path):
    """The fp32 weights of a sharded checkpoint, read in this process (no torch.distributed)."""
    live = pool2.run("ds_api_cases:zero_to_fp32_source", stage, str(tmp_path))[0]
    state = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    assert sorted(state) == sorted(live)
    assert all(torch.equal(state[n], live[n]) for n in live)
    m = load_state_dict_from_zero_checkpoint(SimpleModel(), str(tmp_path))
    assert all(torch.equal(p, live[n]) for n, p in m.named_parameters())


def test_ignore_unused_parameters_false_raises(pool2):
    """DeepSpeed asserts, naming ignore_unused_parameters, when a parameter got no gradient."""
    assert all("ignore_unused_parameters" in r for r in pool2.run("ds_api_cases:unused_parameters", False))
    assert pool2.run("ds_api_cases:unused_parameters", True) == ["trained", "trained"]


@pytest.mark.parametrize("stage", [2, 3])
def test_no_sync_refused_with_partitioned_gradients(pool2, stage):
    with pytest.raises(RankError, match="no_sync context manager is incompatible"):
        pool2.run("ds_api_cases:no_sync_rules", stage)


@pytest.mark.parametrize("stage", [0, 1])
def test_no_sync_reentry_step_and_local_grads(pool2, stage):
    for r in pool2.run("ds_api_cases:no_sync_rules", stage):
        assert "reentry is unsupported" in r["nested"]
        assert "illegal to call Engine.step() inside no_sync" in r["step"]
        assert r["same"] and r["local_grad"] < 1e-6


@pytest.mark.parametrize("mode", ["Fail", "Warn"])
def test_checkpoint_tag_validation_and_empty_dir(pool2, mode, tmp_path):
    res = pool2.run("ds_api_cases:checkpoint_args", mode, str(tmp_path))
    for r in res:
        assert len(r["errors"]) == 2 and all("save_dir" in e for e in r["errors"])
        assert r["exclude_frozen"] == "frozen"
        if mode == "Fail":
            assert "differs from another rank" in r["tag_error"]
        else:
            assert r["path"] == "tag-0"  # rank 0's tag, after a warning


def test_moe_param_group_helpers_pass_dense_groups_and_refuse_experts():
    """deepspeed.moe.utils as DeepSpeed's checkpoint tests call it on dense models: groups come back
    as lists with the same parameters; an expert parameter (allreduce=False) is refused by name."""
    from shardwise.utils.moe import (
        configure_moe_param_groups,
        is_moe_param,
        split_params_into_different_moe_groups_for_optimizer,
    )

    m = SimpleModel()
    params = list(m.parameters())
    groups = split_params_into_different_moe_groups_for_optimizer({"params": m.parameters(), "name": "p", "lr": 2.0})
    assert len(groups) == 1 and groups[0]["params"] == params and groups[0]["lr"] == 2.0
    assert configure_moe_param_groups(params)[0]["params"] == params
    assert not any(is_moe_param(p) for p in params)
    params[0].allreduce, params[0].group_name = False, "ep_size_2"
    with pytest.raises(NotImplementedError, match="expert parameter.*ep_size_2"):
        split_params_into_different_moe_groups_for_optimizer([{"params": params, "name": "p"}])
    with pytest.raises(ValueError, match="param groups"):
        split_params_into_different_moe_groups_for_optimizer("params")


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("op", ["mean", "sum"])
def test_gradient_allreduce_op_mean_or_sum(pool2, stage, op):
    """gradient_allreduce_op: "mean" averages the data-parallel gradients, "sum" adds them (DeepSpeed's
    gradient_average = False); rank r feeds x = [1, 2] + r, so the step is -(x0 + x1) / {2, 1}. Read
    directly after step() at stages 0-2: the stage 1-2 all-gather of the updated shards has finished
    (it once returned early, and rank 0 saw rank 1's element from before the step)."""
    total = torch.tensor([1.0, 2.0]) + torch.tensor([2.0, 3.0])
    want = (-total / (2 if op == "mean" else 1)).tolist()
    for got in pool2.run("ds_api_cases:allreduce_op", stage, op):
        assert got == want


def test_clone_tensors_for_torch_save_copies_views_and_keeps_structure(tmp_path):
    """A view into a flat buffer saved as is drags the whole buffer along; the clone holds its own data."""
    from shardwise.utils import clone_tensors_for_torch_save

    flat = torch.arange(1000.0)
    item = {"a": flat[:4].view(2, 2), "b": [flat[4:6], (flat[6:7], 3)], "c": "text"}
    out = clone_tensors_for_torch_save(item)
    assert out["c"] == "text" and out["b"][1][1] == 3 and isinstance(out["b"][1], tuple)
    for got, src in ((out["a"], item["a"]), (out["b"][0], item["b"][0]), (out["b"][1][0], item["b"][1][0])):
        assert torch.equal(got, src) and got.untyped_storage().nbytes() == src.numel() * 4
    torch.save(out, tmp_path / "clone.pt")
    assert (tmp_path / "clone.pt").stat().st_size < 1000 * 4


@pytest.mark.parametrize("stage", STAGES)
def test_initialize_again_on_the_same_model(pool2, stage):
    """DeepSpeed allows a second initialize() on a model an earlier engine wraps; the new engine trains
    on from the current weights with a fresh optimizer (plain torch: a new AdamW on the same module)."""
    for diff in pool2.run("ds_api_cases:reinitialize", stage):
        assert diff < TOL
