"""Behaviours DeepSpeed's own unit tests expect (tools/ds_conformance.py runs those tests; see
docs/deepspeed_conformance.md). Written from the behaviour, compared with plain torch."""

from __future__ import annotations

import pytest
from torch import nn

from shardwise.launch.net import free_port
from shardwise.utils import (
    get_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    z3_leaf_module,
)

TOL = 1e-5


@pytest.mark.parametrize("stage", [0, 3])
def test_read_only_gather_refuses_edits(pool2, stage):
    """DeepSpeed (sanity checks on): an in-place edit inside GatheredParameters with
    modifier_rank=None raises "in-place modification" on all ranks. shardwise always detects it,
    since the edit would otherwise be dropped (stage 3) or left on one rank (below) silently; at
    stage 3 the weights are left unchanged."""
    res = pool2.run("ds_conformance_cases:read_only_edit", stage, 1)
    for r in res:
        assert r["error"] is not None and "in-place modification" in r["error"] and "modifier_rank" in r["error"]
        if stage == 3:
            assert r["diff"] == 0.0
    assert res[0]["clean"] == res[1]["clean"]  # the later blocks still agree across ranks


@pytest.mark.parametrize("stage", [2, 3])
def test_unwrap_model_for_generation(pool2, stage):
    """deepspeed.runtime.zero.unwrap_model_for_generation: whole parameters inside, and training
    afterwards matches plain torch."""
    for r in pool2.run("ds_conformance_cases:unwrap_for_generation", stage):
        assert r["whole"]
        assert r["forward_diff"] < TOL and r["after_diff"] < TOL


def _tree() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.ReLU()))


def test_leaf_modules_by_name():
    m = _tree()
    found, missing = set_z3_leaf_modules_by_name(m, ["1.0", "nope"], raise_if_not_found=False)
    assert found == [m[1][0]] and missing == ["nope"] and get_z3_leaf_modules(m) == [m[1][0]]
    with pytest.raises(ValueError, match="nope"):
        set_z3_leaf_modules_by_name(m, ["nope"])
    set_z3_leaf_modules_by_name(m, ["1.0"], flag=False)
    assert not z3_leaf_module(m[1][0])


def test_leaf_modules_by_suffix():
    m = _tree()
    found, missing = set_z3_leaf_modules_by_suffix(m, ["0", "zz"], raise_if_not_found=False)
    assert found == [m[0], m[1][0]] and missing == ["zz"]
    with pytest.raises(ValueError, match="zz"):
        set_z3_leaf_modules_by_suffix(m, ["zz"])


class _CustomInit(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        nn.init.constant_(self.fc.weight, 0.5)  # after Linear was built: lost on meta


class _OwnInit(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def test_zero_init_refuses_a_custom_init_it_would_lose():
    """DeepSpeed keeps a parent's in-place init of a child's parameter under zero.Init; shardwise
    would re-run reset_parameters() at materialization (another start than plain torch), so it
    refuses it, naming the parameter, instead of training from other weights silently."""
    import shardwise

    with pytest.raises(ValueError, match=r"zero.Init: 1 parameter.*Linear\.weight of shape \(4, 4\)"):
        with shardwise.zero.Init():
            kept = _CustomInit()  # noqa: F841 (a model nobody keeps needs no check)
    with shardwise.zero.Init():  # modules' own reset_parameters in their __init__ are what is replayed
        m = _OwnInit()
    assert all(p.is_meta for p in m.parameters())
    assert not nn.Linear(2, 2).weight.is_meta  # the watch and the meta patch end with the context


@pytest.mark.subprocess
def test_zero_init_joins_the_launched_job(tmp_path):
    """DeepSpeed's zero.Init initializes torch.distributed when the launcher's environment is set
    (scripts ask for ranks inside it); shardwise joins the job the same way. A process of its own,
    forked after the imports (tests/fresh_ranks.py), with no group until zero.Init makes one."""
    import os

    import fresh_ranks

    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    rank = fresh_ranks.start("process_cases:zero_init_joins_the_job", [], env, tmp_path / "rank0")
    assert rank.wait(timeout=120) == 0, rank.communicate()[1][-2000:]
    assert rank.communicate()[0].split() == ["True", "1"]


def test_version_attributes():
    import shardwise

    assert isinstance(shardwise.__version_major__, int) and isinstance(shardwise.__git_hash__, str)
    assert f"{shardwise.__version_major__}.{shardwise.__version_minor__}.{shardwise.__version_patch__}" == \
        shardwise.__version__


@pytest.mark.parametrize("stage", [1, 3])
def test_safe_update_full_grad_vectorized(pool2, stage):
    assert max(pool2.run("ds_conformance_cases:vectorized_grad_update", stage)) < TOL


def test_repeating_loader_restarts():
    from shardwise.utils import RepeatingLoader

    it = RepeatingLoader([1, 2, 3])
    assert [next(it) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1] and it.epoch == 2


def test_scalar_all_gather_into_tensor(pool2):
    assert pool2.run("ds_conformance_cases:scalar_all_gather_into_tensor") == [[1, 2], [1, 2]]


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_to_fp32_keeps_tied_names(pool2, stage, tmp_path):
    """DeepSpeed's zero_to_fp32 gives a shared parameter under each of its names (one tensor),
    so ``load_state_dict(strict=True)`` works; convert_zero_checkpoint_to_fp32_state_dict writes
    ``pytorch_model.bin`` by default (DeepSpeed's signature), split with an index above max_shard_size."""
    import json

    import torch
    from ds_conformance_cases import Tied

    from shardwise.utils.zero_to_fp32 import (
        convert_zero_checkpoint_to_fp32_state_dict,
        get_fp32_state_dict_from_zero_checkpoint,
    )

    want = pool2.run("ds_conformance_cases:save_tied", stage, str(tmp_path / "ck"))[0]
    state = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ck", tag="t")
    assert set(state) == set(want) and state["a.weight"] is state["b.weight"]
    assert all(torch.equal(state[n], want[n]) for n in want)
    Tied().load_state_dict(state, strict=True)

    assert convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ck", tmp_path / "bin", tag="t") == \
        ["pytorch_model.bin"]
    loaded = torch.load(tmp_path / "bin" / "pytorch_model.bin")
    assert loaded["a.weight"] is loaded["b.weight"] and all(torch.equal(loaded[n], want[n]) for n in want)

    names = convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ck", tmp_path / "split", max_shard_size=100,
                                                       tag="t")
    index = json.loads((tmp_path / "split" / "pytorch_model.bin.index.json").read_text())
    assert len(names) > 1 and set(index["weight_map"]) == set(want)
    merged = {}
    for n in names:
        merged.update(torch.load(tmp_path / "split" / n))
    assert merged["a.weight"] is merged["b.weight"] and all(torch.equal(merged[n], want[n]) for n in want)


def test_config_error_has_deepspeeds_name():
    """Scripts catch ``deepspeed.DeepSpeedConfigError``; a bad config raises it here too."""
    import shardwise
    from shardwise.config import load_config

    with pytest.raises(shardwise.DeepSpeedConfigError, match="tag_validation"):
        load_config({"train_micro_batch_size_per_gpu": 1, "checkpoint": {"tag_validation": "foo"}})


def test_mics_init_builds_deferred_as_init():
    import shardwise

    with shardwise.zero.MiCS_Init(config_dict_or_path={"zero_optimization": {"stage": 3, "mics_shard_size": 1}}):
        m = nn.Linear(3, 3)
    assert m.weight.is_meta and m.weight.shape == (3, 3)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_safe_get_of_a_frozen_parameter_is_none(pool2, stage):
    for r in pool2.run("ds_conformance_cases:frozen_getters", stage):
        assert r == {"frozen_none": True, "trained_values": True}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_read_only_gather_allows_edits_that_lose_nothing(pool2, stage):
    """DeepSpeed's TestZeroToFP32 loads a checkpoint's (equal) weights inside a modifier_rank=None block:
    an edit that changes no persisted value is allowed; one the block would drop still raises."""
    for r in pool2.run("ds_conformance_cases:read_only_edit_kept_or_noop", stage):
        assert r["noop_error"] is None
        if stage == 3:
            assert "in-place modification" in r["same_edit_error"] and r["diff"] == 0.0
        else:
            assert r["same_edit_error"] is None and r["diff"] == pytest.approx(1.0)


def test_tensors_kept_from_a_gathered_block_stay_valid(pool2):
    """DeepSpeed's TestZeroToFP32 keeps ``param.detach().cpu()`` from inside the block (a view on CPU):
    at stage 3 the block's exit lets go of the buffer instead of freeing it under those views."""
    for r in pool2.run("ds_conformance_cases:kept_after_block", 3):
        assert r["same"] and r["after_diff"] < TOL
