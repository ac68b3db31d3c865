"""Property-based fuzzing of checkpoint loading and consolidation (hypothesis, bounded).

One world-1 checkpoint is saved once in this process; each example copies it, damages it one way
(a metadata value replaced or a key deleted, shard bytes flipped or truncated, with or without a
re-hash that makes the metadata agree, a file renamed or replaced by a symlink out of the folder, a
random ``latest``), then loads it into a live engine and consolidates it. The only allowed
outcomes: success with tensors identical to the saved ones, or a ``CheckpointError`` naming the
damaged file with the engine left exactly as it was.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ckpt_cases import _train, same_state, small_engine, snapshot, world1_group
from fuzz_budget import fuzz_settings, memory_bound
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file

from shardwise.checkpoint import CheckpointError, consolidate

TAG = "global_step1"
RANK_FILE = "rank00000.safetensors"
NAMED = ("metadata.json", RANK_FILE, "latest")  # every refusal names one of these files
OUTCOMES: Counter = Counter()  # (test, damage kind, outcome): printed at the end with -s
FUZZ = fuzz_settings(150, function_fixtures=True)  # SHARDWISE_FUZZ=long: thousands (tests/fuzz_budget.py)


def _paths(node, prefix=()) -> list[tuple]:
    """Every key path in a JSON tree (long lists sampled: the first 3 items)."""
    out = [prefix] if prefix else []
    items = node.items() if isinstance(node, dict) else enumerate(node[:3]) if isinstance(node, list) else []
    for k, v in items:
        out += _paths(v, (*prefix, k))
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    created = world1_group()
    root = tmp_path_factory.mktemp("fuzz")
    saver = small_engine(seed=0)
    _train(saver, 0, 1)
    saver.save_checkpoint(root / "ckpt")
    consolidate(root / "ckpt", root / "hf")
    meta = json.loads((root / "ckpt" / TAG / "metadata.json").read_text())
    yield {"ckpt": root / "ckpt", "ref": snapshot(saver), "victim": small_engine(seed=9),
           "paths": _paths({k: v for k, v in meta.items() if k != "rng"}) + [("rng", 0, "python")],
           "hf": load_file(root / "hf" / "model.safetensors")}
    print("\nfuzz outcomes:", dict(sorted(OUTCOMES.items())))
    if created:
        dist.destroy_process_group()


JSON = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(),
                 st.text(max_size=12), st.lists(st.integers(-3, 10**6), max_size=4),
                 st.dictionaries(st.text(max_size=4), st.integers(-2, 2), max_size=2),
                 st.sampled_from(["../x", "/etc/passwd", "..", "float16", "int8", "bfloat16", RANK_FILE,
                                  "latest", "", "a/../../b", 2**40, -1, 0]))
DAMAGE = st.one_of(
    st.tuples(st.just("meta"), st.integers(0, 10**6), JSON),
    st.tuples(st.just("delete"), st.integers(0, 10**6)),
    st.tuples(st.just("flip"), st.integers(0, 10**9), st.integers(1, 255), st.booleans()),
    st.tuples(st.just("header_flip"), st.integers(0, 10**9), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 10**9), st.booleans()),
    st.tuples(st.just("rename"), st.sampled_from(["rank00001.safetensors", ".hidden", "x"])),
    st.tuples(st.just("symlink_out")),
    st.tuples(st.just("latest"), st.binary(max_size=40)),
)


def _rehash(tag_dir: Path) -> None:
    meta_path = tag_dir / "metadata.json"
    meta = json.loads(meta_path.read_text())
    data = (tag_dir / RANK_FILE).read_bytes()
    meta["files"][RANK_FILE] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    meta_path.write_text(json.dumps(meta))


def _damage(ckpt: Path, how: tuple, paths: list[tuple], outside: Path) -> None:
    tag_dir, shard = ckpt / TAG, ckpt / TAG / RANK_FILE
    kind = how[0]
    if kind in ("meta", "delete"):
        meta = json.loads((tag_dir / "metadata.json").read_text())
        *parent, last = paths[how[1] % len(paths)]
        node = meta
        for k in parent:
            node = node[k]
        if kind == "meta":
            node[last] = how[2]
        else:
            del node[last]
        (tag_dir / "metadata.json").write_text(json.dumps(meta))
    elif kind in ("flip", "header_flip"):
        data = bytearray(shard.read_bytes())
        end = 8 + int.from_bytes(data[:8], "little") if kind == "header_flip" else len(data)
        data[how[1] % end] ^= how[2]
        shard.write_bytes(bytes(data))
        if kind == "header_flip" or (kind == "flip" and how[3] and how[1] % end < 8):
            _rehash(tag_dir)  # an attacker's edit that keeps size and hash consistent (header only:
            # a re-hashed flip in the tensor data is a different, valid checkpoint by construction)
    elif kind == "truncate":
        data = shard.read_bytes()
        shard.write_bytes(data[: how[1] % len(data)])
        if how[2]:
            _rehash(tag_dir)
    elif kind == "rename":
        shard.rename(tag_dir / how[1])
    elif kind == "symlink_out":
        shutil.move(shard, outside)
        os.symlink(outside, shard)
    elif kind == "latest":
        (ckpt / "latest").write_bytes(how[1])


def _check_refusal(e: CheckpointError) -> None:
    msg = str(e)
    assert any(n in msg for n in NAMED), msg
    assert "cannot load (" not in msg, msg  # the catch-all for an unexpected exception: a bug


@FUZZ
@given(how=DAMAGE)
def test_fuzz_load(world, how):
    victim = world["victim"]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        shutil.copytree(world["ckpt"], ckpt)
        _damage(ckpt, how, world["paths"], Path(tmp) / "outside.safetensors")
        before = snapshot(victim)
        try:
            with memory_bound(what=f"load_checkpoint of {how}"):
                victim.load_checkpoint(ckpt)
        except CheckpointError as e:
            _check_refusal(e)
            assert same_state(before, snapshot(victim)) == [], how
            OUTCOMES["load", how[0], "refused"] += 1
            return
        OUTCOMES["load", how[0], "loaded"] += 1
        got, ref = snapshot(victim), world["ref"]
        assert same_state({k: ref[k] for k in ("params", "masters")}, got) == [], how
        for k, v in ref["opt_state"].items():  # per-element optimizer state (scalars may be edited)
            if torch.is_tensor(v) and v.numel() > 1:
                assert torch.equal(got["opt_state"][k], v), (how, k)


@FUZZ
@given(how=DAMAGE)
def test_fuzz_consolidate(world, how):
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        shutil.copytree(world["ckpt"], ckpt)
        _damage(ckpt, how, world["paths"], Path(tmp) / "outside.safetensors")
        try:
            with memory_bound(what=f"consolidate of {how}"):
                consolidate(ckpt, Path(tmp) / "hf")
        except CheckpointError as e:
            _check_refusal(e)
            OUTCOMES["consolidate", how[0], "refused"] += 1
            return
        OUTCOMES["consolidate", how[0], "written"] += 1
        got = load_file(Path(tmp) / "hf" / "model.safetensors")
        assert got.keys() == world["hf"].keys(), how
        assert all(torch.equal(got[k], v) for k, v in world["hf"].items()), how
