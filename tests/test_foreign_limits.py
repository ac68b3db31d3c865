"""Foreign checkpoints that used to cost exponential time or unbounded memory before a refusal, read
outside their folder, or pass non-finite and mistyped values; and ``train --resume auto`` of a
DeepSpeed checkpoint (issue 34). The property test over the same readers is ``test_foreign_fuzz.py``.
"""

from __future__ import annotations

import gc
import json
import math
import shutil
import signal
from pathlib import Path

import pytest
import torch
from foreign_gen import (
    DcpDamage,
    DsDamage,
    deepspeed_from_shardwise,
    reset_hwm,
    vm_hwm,
    vm_rss,
    write_dcp,
    write_deepspeed,
)
from train_cases import train_in

from shardwise.checkpoint import CheckpointError, consolidate
from shardwise.checkpoint.formats import open_checkpoint
from shardwise.checkpoint.unpickle import safe_load
from shardwise.cli.consolidate import main as consolidate_main

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "data" / "foreign_ckpt"
SHAPES = [{"a.weight": [6, 5], "b.weight": [7]}]
GROWTH = 32 << 20  # a refused hostile read of a few-KiB folder may grow RSS by Python noise only


def _peak_growth(fn) -> tuple[BaseException | None, int]:
    gc.collect()
    if not reset_hwm():
        pytest.skip("/proc/self/clear_refs is not writable: peak memory cannot be measured here")
    base = vm_rss()
    try:
        fn()
        err = None
    except CheckpointError as e:
        err = e
    return err, vm_hwm() - base


def _with_alarm(seconds: int, fn):
    def fail(*_):
        raise TimeoutError(f"took more than {seconds} s")
    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        return fn()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# -- class 1: a pickle with shared references (a DAG) is walked once per object --------------------
def test_dag_pickle_is_walked_in_linear_time(tmp_path):
    """40 lists, each holding the next one twice: 2**40 paths to the tensor at the bottom."""
    chain: list = [torch.zeros(3)]
    for _ in range(40):
        chain = [chain, chain]
    torch.save({"x": chain}, tmp_path / "dag.pt")
    got = _with_alarm(60, lambda: safe_load(tmp_path / "dag.pt", tmp_path / "dag.pt"))
    assert got["x"][0] is got["x"][1]
    folder = tmp_path / "global_step2"  # and in a whole DeepSpeed checkpoint (client state)
    write_deepspeed(folder, SHAPES, 2, 2, 0, DsDamage(dag=40))
    meta, _ = _with_alarm(60, lambda: open_checkpoint(folder))
    assert meta["counters"]["global_steps"] == 2


# -- class 2: claimed sizes are checked against the file's bytes before anything is allocated ------
@pytest.mark.parametrize("case", ["dcp_huge_size", "ds_stride0", "ds_repeated", "ds_huge_shape"])
def test_huge_claims_are_refused_before_allocating(tmp_path, case):
    folder = tmp_path / "ckpt"
    if case == "dcp_huge_size":  # the chunk claims the whole tensor: 2**27 fp32 = 512 MiB from a 1 KiB item
        write_dcp(folder, {"w": [12]}, 1, 0, DcpDamage(size=("w", [2**27]), chunk=("w", 0, [0], [2**27])))
        named = ".metadata"
    elif case == "ds_stride0":  # rank 0's flat: 2**27 elements of stride 0 over one stored element
        write_deepspeed(folder, SHAPES, 1, 2, 0, DsDamage(view={(0, 0): (0, 0, 0, 2**27)}))
        named = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    elif case == "ds_repeated":  # 100 groups whose flat and states are one 512 KiB tensor each: 150 MiB if copied
        write_deepspeed(folder, [{f"g{i}.w": [256, 512]} for i in range(100)], 1, 2, 0, DsDamage(alias=True))
        named = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    else:  # param_shapes claims 2**40 elements of a 42-element group
        write_deepspeed(folder, SHAPES, 1, 2, 0, DsDamage(shape=("a.weight", [2**20, 2**20])))
        named = "mp_rank_00_model_states.pt"
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    err, grew = _peak_growth(lambda: open_checkpoint(folder))
    assert err is not None and named in str(err) and "\n" not in str(err), err
    print(f"[measured] {case}: {size} bytes of files, refused with peak RSS growth {grew >> 10} KiB: {err}")
    assert grew < GROWTH, grew  # nothing the files claim was allocated (the refusals come before any read)


# -- class 3: reads stay in the folder given ---------------------------------------------------------
def test_consolidate_does_not_read_config_json_above_the_folder_given(tmp_path, capsys):
    trainer = tmp_path / "checkpoint-2"
    shutil.copytree(FIXTURES / "hf_trainer_z2" / "checkpoint-2", trainer)
    (trainer / "config.json").write_text(json.dumps({"model_type": "llama", "marker": "parent"}))
    tag = trainer / "global_step2"  # the tag folder itself: its parent's config.json is outside it
    with pytest.raises(CheckpointError, match=r"global_step2: has no config\.json"):
        consolidate(tag, tmp_path / "out_tag")
    assert consolidate_main([str(tag), str(tmp_path / "out_w"), "--weights-only"]) == 0
    assert not (tmp_path / "out_w" / "config.json").exists()
    consolidate(trainer, tmp_path / "out_trainer")  # checkpoint-2 given: its own config.json is inside
    assert json.loads((tmp_path / "out_trainer" / "config.json").read_text())["marker"] == "parent"


# -- class 4: non-finite and mistyped values are refused by file and key --------------------------------
@pytest.mark.parametrize("damage,key", [
    (DsDamage(step=math.nan), r"base_optimizer_state\.state\[0\]\.step"),
    (DsDamage(step=math.inf), r"base_optimizer_state\.state\[0\]\.step"),
    (DsDamage(nan_moment=True), r"base_optimizer_state\.state\[0\]\.exp_avg_sq"),
    (DsDamage(global_steps=2.5), r"'global_steps' is 2\.5"),
    (DsDamage(global_steps="7"), r"'global_steps' is '7'"),
    (DsDamage(shape=("b.weight", [9])), r"mp_rank_00_model_states\.pt: param_shapes gives b\.weight the shape \[9\]"),
    (DsDamage(shape=("b.weight", [12])), r"param_shapes .*b\.weight: \[12\]"),
])
def test_bad_values_are_refused_naming_file_and_key(tmp_path, capsys, damage, key):
    folder = tmp_path / "global_step2"
    write_deepspeed(folder, SHAPES, 2, 2, 0, damage)
    with pytest.raises(CheckpointError, match=key) as e:
        open_checkpoint(folder)
    assert "\n" not in str(e.value) and "global_step2" in str(e.value)
    assert consolidate_main([str(folder), str(tmp_path / "out"), "--weights-only"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err


def test_non_finite_dcp_optimizer_state_is_refused(tmp_path):
    src = FIXTURES / "fsdp2_dcp"
    got = open_checkpoint(src)[0]
    assert got["counters"]["global_steps"] == 2
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo  # noqa: F401 (the pickle's classes)

    dcp = tmp_path / "dcp"
    shutil.copytree(src, dcp)
    meta = pickle.loads((dcp / ".metadata").read_bytes())  # our own fixture: trusted
    key = next(k for k in meta.state_dict_metadata if k.endswith("exp_avg_sq") and "norm" in k)
    idx, info = next((i, v) for i, v in meta.storage_data.items() if i.fqn == key)
    raw = bytearray((dcp / info.relative_path).read_bytes())
    import io

    t = torch.load(io.BytesIO(bytes(raw[info.offset:info.offset + info.length])), weights_only=True)
    t.view(-1)[0] = math.nan
    b = io.BytesIO()
    torch.save(t, b)
    raw += b.getvalue()
    meta.storage_data[idx] = _StorageInfo(info.relative_path, len(raw) - len(b.getvalue()), len(b.getvalue()))
    (dcp / info.relative_path).write_bytes(bytes(raw))
    (dcp / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(CheckpointError, match=r"\.metadata: optimizer state 'exp_avg_sq' of .*norm.* non-finite"):
        open_checkpoint(dcp)


def test_model_folder_with_weights_cut_short_names_the_file(tmp_path, capsys):
    from inference_cases import save_tiny

    from shardwise.cli import main

    folder = tmp_path / "m"
    save_tiny("llama", str(folder))
    raw = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(raw[:len(raw) // 2])
    for extra in ([], ["--offload", "disk"]):
        assert main(["generate", "--model", str(folder), "--prompt", "w1", *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"{folder / 'model.safetensors'}: damaged or cut short" in err, err


# -- class 5: train --resume auto continues a DeepSpeed checkpoint, as the docs say ---------------------
def test_train_resume_auto_of_a_deepspeed_checkpoint(tmp_path, pool1):
    """A run saved at step 2 is rewritten in DeepSpeed's ZeRO-2 layout into a fresh run folder;
    ``--resume auto`` there continues at step 2 and its losses at steps 3-4 equal the original run's
    (same masters, moments, step and data order: bit for bit in one process)."""
    ds = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 0,
          "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, "zero_optimization": {"stage": 2}}
    (tmp_path / "ds.json").write_text(json.dumps(ds))

    def train(out: Path) -> None:  # the CLI's entry in a one-rank pool (tests/train_cases.py)
        train_in(pool1, ["--config", str(tmp_path / "ds.json"), "--model", "llama-micro", "--seq", "32", "--steps",
                         "4", "--save-every", "2", "--keep", "0", "--eval-every", "0", "--sample-tokens", "0",
                         "--no-export", "--out", str(out), "--resume", "auto"])

    def losses(out: Path) -> dict[int, float]:
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return {m["step"]: m["loss"] for m in rows if m["kind"] == "train"}

    train(tmp_path / "a")
    b = tmp_path / "b"
    deepspeed_from_shardwise(tmp_path / "a" / "checkpoints" / "global_step2", b / "checkpoints" / "global_step2")
    (b / "checkpoints" / "latest").write_text("global_step2")
    train(b)
    want, got = losses(tmp_path / "a"), losses(b)
    assert sorted(got) == [3, 4], got
    assert got == {s: want[s] for s in (3, 4)}, (got, want)


@pytest.mark.parametrize("fmt", ["deepspeed", "dcp"])
def test_reading_a_checkpoint_stays_within_the_stated_memory_bound(tmp_path, fmt):
    """docs/reliability.md: a foreign read grows peak RSS by at most 4x the bytes of the files
    (every tensor is returned whole; plus the files' pages or bytes and the tensor being built)."""
    folder = tmp_path / "ckpt"
    if fmt == "deepspeed":  # 4 Mi fp32 parameters: 16 MiB masters, 32 MiB of moments, 16 MiB module
        write_deepspeed(folder, [{"a": [1024, 2048], "b": [1024, 2048]}], 2, 2, 0, DsDamage())
    else:  # 4 Mi fp32 elements in 3 chunks each
        write_dcp(folder, {"a": [1024, 2048], "b": [2048, 1024]}, 3, 0, DcpDamage())
    gc.collect()
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    err, grew = _peak_growth(lambda: open_checkpoint(folder))
    assert err is None, err
    print(f"[measured] {fmt}: {size >> 20} MiB of files, peak RSS growth {grew >> 20} MiB "
          f"({grew / size:.2f}x the files)")
    assert grew <= 4 * size + (4 << 20), (grew, size)
