"""Hostile and damaged checkpoints (issue 11): every case refused by name, the engine untouched.

Single process (a 1-rank gloo group in this process) except the cross-rank agreement test.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ckpt_cases import _train, same_state, small_engine, snapshot, world1_group
from tiny_models import build

from shardwise.checkpoint import CheckpointError, consolidate
from shardwise.checkpoint.validate import confined_path
from shardwise.cli.consolidate import main as consolidate_main

TAG = "global_step1"
RANK_FILE = "rank00000.safetensors"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One world-1 stage-2 checkpoint after one step, and the engine that wrote it."""
    created = world1_group()
    root = tmp_path_factory.mktemp("hostile")
    engine = small_engine(seed=0)
    _train(engine, 0, 1)
    engine.save_checkpoint(root / "ckpt")
    yield {"root": root, "ckpt": root / "ckpt", "engine": engine}
    if created:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def victim(saved):
    """A trained engine (another seed) that every refused load must leave exactly as it was."""
    engine = small_engine(seed=9)
    _train(engine, 0, 1)
    return engine


def _copy(saved, tmp_path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(saved["ckpt"], dst, symlinks=True)
    return dst


def _meta(ckpt: Path) -> tuple[dict, Path]:
    path = ckpt / TAG / "metadata.json"
    return json.loads(path.read_text()), path


def _refused(engine, ckpt: Path, names: str, **kw) -> str:
    """Load must raise CheckpointError whose message names ``names``; nothing in the engine changes."""
    before = snapshot(engine)
    with pytest.raises(CheckpointError) as ei:
        engine.load_checkpoint(ckpt, **kw)
    assert names in str(ei.value), str(ei.value)
    assert same_state(before, snapshot(engine)) == []
    return str(ei.value)


# -- 1. path confinement ---------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["/etc/passwd", "../../../../etc/passwd", "sub/../../x", "a\\..\\b"])
def test_metadata_file_list_outside_folder_refused(saved, victim, tmp_path, bad):
    ckpt = _copy(saved, tmp_path)
    meta, path = _meta(ckpt)
    meta["files"] = {bad: meta["files"][RANK_FILE]}
    for t in meta["tensors"].values():
        for s in t["segments"]:
            s["file"] = bad
    path.write_text(json.dumps(meta))
    msg = _refused(victim, ckpt, "metadata.json")
    assert "outside" in msg or "plain relative" in msg
    with pytest.raises(CheckpointError, match="metadata.json"):
        consolidate(ckpt, tmp_path / "out")


def test_symlinked_shard_out_of_folder_refused(saved, victim, tmp_path):
    ckpt = _copy(saved, tmp_path)
    outside = tmp_path / "elsewhere.safetensors"
    shard = ckpt / TAG / RANK_FILE
    shutil.move(shard, outside)
    os.symlink(outside, shard)  # same bytes, same hash: only containment refuses it
    assert "outside" in _refused(victim, ckpt, RANK_FILE)


@pytest.mark.parametrize("content", [b"../../etc", b"/etc", b"\xff\xfe\x00binary", b"", b"x" * 5000])
def test_bad_latest_refused(saved, victim, tmp_path, content):
    ckpt = _copy(saved, tmp_path)
    (ckpt / "latest").write_bytes(content)
    _refused(victim, ckpt, "latest")
    assert consolidate_main([str(ckpt), str(tmp_path / "out")]) == 2


def test_symlinked_latest_and_tag_refused(saved, victim, tmp_path):
    ckpt = _copy(saved, tmp_path)
    (tmp_path / "secret").write_text(TAG)
    (ckpt / "latest").unlink()
    os.symlink(tmp_path / "secret", ckpt / "latest")
    _refused(victim, ckpt, "latest")
    os.unlink(ckpt / "latest")
    (ckpt / "latest").write_text("evil")
    os.symlink(tmp_path, ckpt / "evil")  # a tag folder that is a link out of the checkpoint folder
    _refused(victim, ckpt, "outside")


def test_weight_map_outside_folder_refused(tmp_path):
    from shardwise.sharded_init.context import weight_map

    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-1.safetensors", "b": "../../etc/passwd"}}))
    with pytest.raises(CheckpointError, match="model.safetensors.index.json.*outside"):
        weight_map(tmp_path)
    with pytest.raises(CheckpointError, match="outside"):
        confined_path(tmp_path, "/abs", "x.json")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "m-1.safetensors"}}))
    assert weight_map(tmp_path) == {"a": (tmp_path / "m-1.safetensors").resolve()}


# -- 2. schema and model matching ------------------------------------------------------------------
def _edit(meta: dict, where: str, value) -> None:
    *path, last = where.split("/")
    node = meta
    for k in path:
        node = node[int(k)] if isinstance(node, list) else node[k]
    node[int(last) if isinstance(node, list) else last] = value


EMB = "model.embed_tokens.weight"
EDITS = [  # (slash path in metadata.json, bad value)
    ("state_dtypes/exp_avg", "int8"), ("state_dtypes/exp_avg", "float16"),
    ("counters/global_steps", "3"), ("counters/micro_steps", -1), ("counters/skipped_steps", 1.5),
    ("param_groups/0/lr", "abc"), ("param_groups/0/lr", 1e999), ("param_groups/0/lr", True),
    ("param_groups/0/betas", [0.9]), ("lr_scheduler/last_epoch", "x"),
    (f"tensors/{EMB}/segments/0/start", -5), (f"tensors/{EMB}/segments/0/start", 3),
    (f"tensors/{EMB}/shape", [2**40, 2**40]), (f"tensors/{EMB}/numel", 10**18),
    (f"tensors/{EMB}/dtype", "int8"), (f"scalars/{EMB}/step/value", "2"),
    ("version", 99), ("format", "other"), ("rng/0/python", [1, 2]), ("order", []),
]


@pytest.mark.parametrize(("where", "value"), EDITS, ids=[f"{w}={v!r}"[:40] for w, v in EDITS])
def test_bad_metadata_value_refused(saved, victim, tmp_path, where, value):
    ckpt = _copy(saved, tmp_path)
    meta, path = _meta(ckpt)
    _edit(meta, where, value)
    path.write_text(json.dumps(meta))
    _refused(victim, ckpt, "metadata.json")


@pytest.mark.parametrize("raw", [b"[1, 2]", b"{}", b"\xff\xfe{", b'{"a": NaN}', b"[" * 100_000],
                         ids=["list", "empty", "non-utf8", "nan", "deep"])
def test_malformed_metadata_refused(saved, victim, tmp_path, raw):
    ckpt = _copy(saved, tmp_path)
    (ckpt / TAG / "metadata.json").write_bytes(raw)
    _refused(victim, ckpt, "metadata.json")


def test_missing_files_key_and_missing_file_refused(saved, victim, tmp_path):
    ckpt = _copy(saved, tmp_path)
    meta, path = _meta(ckpt)
    del meta["files"]
    path.write_text(json.dumps(meta))
    _refused(victim, ckpt, "metadata.json")
    ckpt2 = _copy(saved, tmp_path / "b")
    (ckpt2 / TAG / RANK_FILE).unlink()
    assert "missing" in _refused(victim, ckpt2, RANK_FILE)
    (ckpt2 / TAG / "metadata.json").unlink()
    _refused(victim, ckpt2, "metadata.json")


def _rehash(ckpt: Path, mutate) -> None:
    """Change the shard's bytes and make metadata.json agree (size and sha256), as an attacker would."""
    import hashlib

    shard = ckpt / TAG / RANK_FILE
    data = bytearray(shard.read_bytes())
    shard.write_bytes(bytes(mutate(data)))
    meta, path = _meta(ckpt)
    meta["files"][RANK_FILE] = {"sha256": hashlib.sha256(shard.read_bytes()).hexdigest(),
                                "bytes": shard.stat().st_size}
    path.write_text(json.dumps(meta))


def _header_swap(data: bytearray, old: bytes, new: bytes) -> bytearray:
    n = int.from_bytes(data[:8], "little")
    head = bytes(data[8:8 + n])
    assert old in head
    return data[:8] + bytearray(head.replace(old, new, 1)) + data[8 + n:]


@pytest.mark.parametrize(("old", "new"), [(b'"F32"', b'"I32"'), (b'"F32"', b'"F3X"'), (b"{", b"["),
                                          (b'"master/', b'"maste_/')])
def test_rehashed_shard_with_flipped_header_refused(saved, victim, tmp_path, old, new):
    ckpt = _copy(saved, tmp_path)
    _rehash(ckpt, lambda d: _header_swap(d, old, new))
    _refused(victim, ckpt, RANK_FILE)
    with pytest.raises(CheckpointError, match=RANK_FILE):
        consolidate(ckpt, tmp_path / "out")


def test_two_layer_checkpoint_into_one_layer_model(saved, tmp_path):
    model = build("llama", seed=4)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    engine = small_engine(model=model)
    msg = _refused(engine, saved["ckpt"], "load_module_strict=False")
    assert "unexpected" in msg and "model.layers.1." in msg
    before = snapshot(engine)
    engine.load_checkpoint(saved["ckpt"], load_module_strict=False, load_optimizer_states=False)
    src = dict(saved["engine"].module.named_parameters())
    for n, p in engine.module.named_parameters():  # every shared name loaded, bit for bit
        assert torch.equal(p, src[n]), n
    assert not torch.equal(before["params"][EMB], src[EMB])


# -- 3. all ranks agree: one rank's damaged file, the same error everywhere, nothing changed --------------
def test_one_rank_damaged_file_same_error_on_every_rank(pool2, tmp_path):
    pool2.run("ckpt_cases:train_and_save", "llama", 2, str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    victim_file = tmp_path / "ckpt" / "global_step2" / "rank00001.safetensors"
    data = bytearray(victim_file.read_bytes())
    data[-10:] = bytes(b ^ 0xFF for b in data[-10:])  # only rank 1 reads this file (world 2, stage 2)
    victim_file.write_bytes(bytes(data))
    out = pool2.run("ckpt_cases:failed_load_leaves_engine", str(tmp_path / "ckpt"))
    assert out[0]["msg"] == out[1]["msg"], out
    assert out[0]["msg"].startswith("CheckpointError") and "rank00001.safetensors" in out[0]["msg"]
    assert "RanksDiverged" not in out[0]["msg"]
    assert out[0]["changed"] == [] and out[1]["changed"] == []


# -- 4/5. consolidation needs a config; stale partial folders -----------------------------------------
def test_consolidate_without_config(saved, tmp_path):
    ckpt = _copy(saved, tmp_path)
    cfg = ckpt / TAG / "config.json"
    shutil.move(cfg, tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="config.json"):
        consolidate(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before anything was written
    assert consolidate_main([str(ckpt), str(tmp_path / "out"), "--config", str(tmp_path / "config.json")]) == 0
    assert (tmp_path / "out" / "config.json").is_file()
    meta, path = _meta(ckpt)
    meta["has_model_config"] = False
    path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="--weights-only"):
        consolidate(ckpt, tmp_path / "out2")
    assert consolidate_main([str(ckpt), str(tmp_path / "out2"), "--weights-only"]) == 0
    assert not (tmp_path / "out2" / "config.json").exists()


def test_next_save_removes_stale_partials_of_any_tag(saved, tmp_path):
    root = tmp_path / "ckpt"
    for tag in ("global_step7", "other"):
        (root / f".{tag}.partial").mkdir(parents=True)
        (root / f".{tag}.partial" / "rank00000.safetensors").write_bytes(b"half")
    saved["engine"].save_checkpoint(root, tag="fresh")
    assert sorted(p.name for p in root.iterdir()) == ["fresh", "latest", "zero_to_fp32.py"]
    assert (root / "latest").read_text() == "fresh"
