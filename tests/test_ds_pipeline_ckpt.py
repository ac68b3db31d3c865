"""DeepSpeed 0.19.8 PipelineModule checkpoints (``layer_XX-model_states.pt``, issue 56 item 1) through
the foreign-checkpoint import: loaded at PP 1, 2 and 4 (DeepSpeed resumes at its own degree only),
DeepSpeed's weights bit for bit by global layer index, its ZeRO-1 optimizer state mapped so that the
run continues with DeepSpeed's own losses; hostile layer files refused in one line naming the file."""

from __future__ import annotations

from pathlib import Path

import pytest

# fixture: tests/data/pipeline_ckpt/make_fixture.py (PP 2 x DP 1, ZeRO-1, saved after 2 batches)
FOLDER = Path(__file__).resolve().parent / "data" / "pipeline_ckpt" / "z1" / "global_step2"


@pytest.mark.parametrize("stages", [1, 2, 4])
def test_deepspeed_pipeline_checkpoint_loads_at_any_pp_degree(request, stages):
    pool = request.getfixturevalue(f"pool{stages}")  # one stage per rank: one data-parallel replica, as DeepSpeed's
    res = pool.run("ds_pipeline_ckpt_cases:resume", stages)
    assert sorted({r["stage"] for r in res}) == list(range(stages))
    names = sorted(n for r in res for n in r["names"])
    assert len(names) == 14 and len(set(names)) == 14  # every layer's weight and bias, each on one stage
    for r in res:
        assert r["differ"] == [], r["differ"]  # DeepSpeed's weights, bit for bit
        assert r["steps"] == 2
        ds = r["ds"]["after"]  # DeepSpeed's batches 3-4 after its save: the optimizer state carried over
        assert r["losses"][0] == ds[0]  # DeepSpeed's weights: the same bits
        # after one step on the loaded Adam moments and step: 2.7e-7 relative apart (measured), as far as this
        # engine's run without the save is from DeepSpeed's own at that batch (the test below)
        assert r["losses"][1] == pytest.approx(ds[1], rel=1e-6, abs=0), (r["losses"], ds)
    assert pool.run("ds_pipeline_ckpt_cases:resume", stages, load_optimizer_states=False)[-1]["losses"][1] != \
        pytest.approx(res[-1]["losses"][1], rel=1e-4)  # fresh moments: the check above tells them apart


@pytest.mark.parametrize("stages", [1, 2, 4])
def test_pp2_x_dp2_checkpoint_loads_at_any_pp_degree(pool4, stages):
    """DeepSpeed's PP 2 x DP 2 checkpoint (each stage's ZeRO-1 optimizer over its 2 data-parallel rank
    files) on 4 ranks at PP 1 x DP 4, PP 2 x DP 2 and PP 4: DeepSpeed's weights bit for bit; at PP 2 x
    DP 2 (DeepSpeed's data layout) its next loss bit for bit and the one after within 1e-6 relative."""
    res = pool4.run("ds_pipeline_ckpt_cases:resume", stages, fixture="z1_dp2")
    assert len({n for r in res for n in r["names"]}) == 14
    for r in res:
        assert r["differ"] == [] and r["steps"] == 2, r["differ"]
        if stages == 2:
            ds = r["ds"]["after"]
            assert r["losses"][0] == ds[0] and r["losses"][1] == pytest.approx(ds[1], rel=1e-6, abs=0), r["losses"]


def test_the_resumed_run_is_the_run_without_a_save(pool2):
    """Loaded from DeepSpeed's checkpoint at PP 2, batches 3-4 give bit for bit what this engine gives
    training the 4 batches straight: nothing of the optimizer state was lost or rounded in the import."""
    resumed = pool2.run("ds_pipeline_ckpt_cases:resume", 2)[0]
    straight = pool2.run("ds_pipeline_ckpt_cases:straight", 2)[0]
    assert straight[:2] == resumed["ds"]["before"]  # DeepSpeed's losses before its save, bit for bit
    assert resumed["losses"] == straight[2:]


def _damaged(tmp_path, damage: str):
    """A copy of the fixture's global_step2 with one layer file damaged; the file the error must name."""
    import shutil

    import torch
    from foreign_gen import stored

    from shardwise.checkpoint.unpickle import safe_load

    folder = tmp_path / "global_step2"
    shutil.copytree(FOLDER, folder)
    layer = folder / "layer_03-model_states.pt"
    sd = dict(safe_load(layer, layer))
    if damage == "shape":  # a weight one row larger than param_shapes says
        sd["fc.weight"] = torch.zeros(9, 8)
    elif damage == "size":  # 2**27 elements (512 MiB) claimed over one stored element (stride 0)
        sd["fc.weight"] = stored(torch.ones(1), (0, 0, 0, 2**27))
    elif damage == "name":  # a tensor no stage lists
        sd["fc.extra"] = torch.zeros(3)
    elif damage == "index":  # a layer past the last one (layer 6, the head, is the last)
        layer = folder / "layer_09-model_states.pt"
    elif damage == "zero0":  # no optimizer files: ZeRO-0's optimizer lives in the model states, not mapped
        for f in folder.glob("zero_pp_rank_*"):
            f.unlink()
        return folder, "no *_optim_states.pt files"
    elif damage == "missing":
        layer.unlink()
        return folder, "mp_rank_00_model_states.pt"
    else:  # truncated
        layer.write_bytes(layer.read_bytes()[:900])
        return folder, layer.name
    torch.save(sd, layer)
    return folder, layer.name


@pytest.mark.parametrize("damage", ["shape", "size", "name", "index", "missing", "truncated", "zero0"])
def test_a_lying_layer_file_is_refused_naming_it(tmp_path, damage):
    from shardwise.checkpoint import CheckpointError
    from shardwise.checkpoint.formats import open_checkpoint

    folder, named = _damaged(tmp_path, damage)
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(folder)
    msg = str(err.value)
    assert named in msg and "\n" not in msg, msg
    if damage == "index":
        assert "layer index 9 is out of range" in msg


def test_a_layer_file_beside_a_plain_zero_checkpoint_is_refused(tmp_path):
    """(Read as a pipeline's checkpoint: its model states do not name parameters by layer index.)"""
    import shutil

    from shardwise.checkpoint import CheckpointError
    from shardwise.checkpoint.formats import open_checkpoint

    folder = tmp_path / "global_step2"
    shutil.copytree(FOLDER.parents[2] / "foreign_ckpt" / "ds_z2_frozen" / "global_step2", folder)
    (folder / "layer_01-model_states.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"mp_rank_00_model_states\.pt: parameter .* named neither by its layer "
                                              r"index .*not a PipelineModule's checkpoint"):
        open_checkpoint(folder)


@pytest.mark.parametrize("stages", [1, 2, 4])
def test_tied_deepspeed_checkpoint_loads_at_any_pp_degree(request, stages):
    """DeepSpeed's PP 2 checkpoint of a weight tied across the stages (``TiedLayerSpec``: written once, in
    ``layer_00``, listed and stepped by both stages' optimizers as ``tied_modules.proj.weight``) at PP 1, 2
    and 4: DeepSpeed's weights bit for bit (the tied one once, on every stage using it), its next loss bit
    for bit."""
    pool = request.getfixturevalue(f"pool{stages}")
    res = pool.run("ds_pipeline_ckpt_cases:resume", stages, fixture="z1_tied")
    assert res[0]["ds"]["tied_copies_equal"] is True  # DeepSpeed's two copies were equal: the join is not a choice
    names = {n for r in res for n in r["names"]}
    assert len(names) == 13 and "tied_modules.proj.weight" in names
    if stages > 1:  # the first and the last stage both hold the tied weight
        assert "tied_modules.proj.weight" in res[0]["names"] and "tied_modules.proj.weight" in res[-1]["names"]
    for r in res:
        assert r["differ"] == [] and r["steps"] == 2, r["differ"]
        ds = r["ds"]["after"]
        assert r["losses"][0] == ds[0]
        assert r["losses"][1] == pytest.approx(ds[1], rel=1e-6, abs=0), (r["losses"], ds)


def _damaged_tied(tmp_path, damage: str):
    """A copy of the tied fixture's global_step2 with its tied weight damaged; the file the error must name."""
    import shutil

    import torch

    from shardwise.checkpoint.unpickle import safe_load

    folder = tmp_path / "global_step2"
    shutil.copytree(FOLDER.parents[1] / "z1_tied" / "global_step2", folder)
    layer = folder / "layer_00-model_states.pt"  # the tied module (the head's use is a forward_fn: no file)
    weight = safe_load(layer, layer)["weight"]
    if damage == "shape":  # the tied weight one row larger than both stages' param_shapes say
        torch.save({"weight": torch.zeros(9, 8)}, layer)
    elif damage == "missing":  # the one file that holds the tied weight
        layer.unlink()
        return folder, "mp_rank_00_model_states.pt: lists the tied tied_modules.proj.weight"
    elif damage in ("ambiguous", "partial"):  # stage 0 lists another tied key like proj, or a bias of proj
        layer = folder / "mp_rank_00_model_states.pt"
        model = dict(safe_load(layer, layer))
        extra = {"ambiguous": ("tied_modules.emb.weight", [8, 8]), "partial": ("tied_modules.proj.bias", [8])}[damage]
        model["param_shapes"] = [{**model["param_shapes"][0], extra[0]: torch.Size(extra[1])}]
        torch.save(model, layer)
        return folder, "layer_00-model_states.pt: " + ("its tensors ['weight'] fit the tied layers" if damage ==
                                                       "ambiguous" else "holds tied layer 'proj' without its bias")
    elif damage in ("duplicate", "same"):  # a second file of the tied module (as when two uses are modules)
        layer = folder / "layer_07-model_states.pt"
        torch.save({"weight": weight + (1e-3 if damage == "duplicate" else 0.0)}, layer)
    else:  # "optimizer": stage 1's copy of the tied master one element off (bytes changed in place)
        layer = folder / "zero_pp_rank_0_mp_rank_01_optim_states.pt"
        flat = safe_load(layer, layer)["optimizer_state_dict"]["single_partition_of_fp32_groups"][0].detach()
        data = bytearray(layer.read_bytes())
        at = bytes(data).find(flat[:4].numpy().tobytes())  # its first 64 elements: the tied weight (param_shapes)
        data[at:at + 4] = torch.tensor([float(flat[0]) * 1.5]).numpy().tobytes()
        layer.write_bytes(bytes(data))
    return folder, layer.name


@pytest.mark.parametrize("damage", ["shape", "missing", "duplicate", "optimizer", "ambiguous", "partial"])
def test_a_lying_tied_layer_is_refused_naming_the_file(tmp_path, damage):
    """Tied weights in DeepSpeed's pipeline checkpoint: a wrong shape, the file missing, a second file or a
    stage's optimizer copy with other values, a file that fits two tied keys or lacks a tensor of its key: one line
    naming the file; an equal second file is read."""
    from shardwise.checkpoint import CheckpointError
    from shardwise.checkpoint.formats import open_checkpoint

    folder, named = _damaged_tied(tmp_path, damage)
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(folder)
    msg = str(err.value)
    assert named in msg and "\n" not in msg, msg
    same, _ = _damaged_tied(tmp_path / "same", "same")
    meta, _ = open_checkpoint(same)
    assert meta["tensors"]["tied_modules.proj.weight"]["shape"] == [8, 8]
