"""Checkpoints of models with frozen parameters (frozen layers; LoRA: base frozen, adapters trained).

Frozen stage-3 parameters are saved shard by shard from their groups' stores and load at any world
size and stage; ``exclude_frozen_parameters=True`` leaves them out and a load keeps the model's own.
"""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
from ckpt_cases import STEPS, world1_group
from frozen_ckpt_cases import frozen_param_names, load_run, make_model, save_run
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from zero_cases import max_rel_diff

from shardwise.checkpoint import CheckpointError, consolidate
from shardwise.checkpoint.validate import parse_metadata
from shardwise.utils.zero_to_fp32 import (
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)

CROSS_TOL = 1e-6  # another world size: only the reduction order differs
TAG = f"global_step{STEPS // 2}"


def _meta(ckpt) -> dict:
    return json.loads((ckpt / TAG / "metadata.json").read_text())


def _bytes(ckpt) -> int:
    return sum(f.stat().st_size for f in (ckpt / TAG).glob("*.safetensors"))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("kind", ["layers", "lora"])
def test_resume_is_bitwise_identical(pool2, tmp_path, kind, stage):
    """Train, save halfway, load into a fresh engine (other seed), continue: the uninterrupted run."""
    base = pool2.run("frozen_ckpt_cases:save_run", kind, stage, str(tmp_path / "ckpt"))
    res = pool2.run("frozen_ckpt_cases:load_run", kind, stage, str(tmp_path / "ckpt"))
    for r in range(2):
        assert res[r]["losses"] == base[r]["losses"][STEPS // 2:]
        assert res[r]["lr"] == base[r]["lr"] and res[r]["global_steps"] == STEPS
    frozen = frozen_param_names(kind)
    fresh, loaded, want = res[0]["fresh"], res[0]["loaded"], base[0]["at_save"]
    assert all(not torch.equal(fresh[n], want[n]) for n in frozen if want[n].dim() > 1)  # norms start at 1
    assert all(torch.equal(loaded[n], w) for n, w in want.items())
    assert all(torch.equal(res[0]["weights"][n], w) for n, w in base[0]["weights"].items())
    meta = _meta(tmp_path / "ckpt")
    assert meta["version"] == 3 and meta["excluded_frozen"] == []
    assert {n.split("@")[0] for n in meta["frozen"]} == set(frozen) and not set(frozen) & set(meta["tensors"])
    segs = meta["frozen"][frozen[0]]["segments"]
    if stage == 3:  # each rank wrote its own shard of the frozen parameters: nothing gathered
        assert {s["file"] for s in meta["frozen"][frozen[-1]]["segments"]} <= {"rank00000.safetensors",
                                                                             "rank00001.safetensors"}
        assert sum(len(meta["frozen"][n]["segments"]) for n in frozen) > len(frozen)
    else:  # replicated: written whole by rank 0
        assert segs == [{"file": "rank00000.safetensors", "start": 0, "stop": meta["frozen"][frozen[0]]["numel"]}]


def test_bf16_stage3_resume_is_bitwise_identical(pool2, tmp_path):
    """bf16: frozen shards are saved in bf16 (no fp32 copy exists) and come back unchanged."""
    base = pool2.run("frozen_ckpt_cases:save_run", "lora", 3, str(tmp_path / "ckpt"), precision="bf16")
    res = pool2.run("frozen_ckpt_cases:load_run", "lora", 3, str(tmp_path / "ckpt"), precision="bf16")
    for r in range(2):
        assert res[r]["losses"] == base[r]["losses"][STEPS // 2:]
    assert all(torch.equal(res[0]["loaded"][n], w) for n, w in base[0]["at_save"].items())
    assert all(torch.equal(res[0]["weights"][n], w) for n, w in base[0]["weights"].items())
    meta = _meta(tmp_path / "ckpt")
    assert {f["dtype"] for f in meta["frozen"].values()} == {"bfloat16"}


def test_functional_api_exclude_frozen_parameters(pool2, tmp_path):
    assert pool2.run("frozen_ckpt_cases:functional_api", str(tmp_path)) == [{False: True, True: True}] * 2


@pytest.fixture(scope="module")
def lora3(pool2, tmp_path_factory):
    """LoRA at stage 3, world 2: a full checkpoint, an excluded one (same step), and an HF export."""
    root = tmp_path_factory.mktemp("lora3")
    base = pool2.run("frozen_ckpt_cases:save_run", "lora", 3, str(root / "full"), hf16=str(root / "hf16"))
    excl = pool2.run("frozen_ckpt_cases:save_run", "lora", 3, str(root / "excl"), exclude=True)
    return {"base": base, "excl": excl, "root": root}


def test_stage3_world2_to_stage1_world1(lora3):
    """The stage-3 two-rank checkpoint continues on one rank at stage 1 as the uninterrupted run."""
    world1_group()
    base = lora3["base"]
    res = load_run("lora", 1, str(lora3["root"] / "full"))
    mean = [(a + b) / 2 for a, b in zip(base[0]["losses"], base[1]["losses"], strict=True)]
    assert res["losses"] == pytest.approx(mean[STEPS // 2:], rel=CROSS_TOL)
    assert all(torch.equal(res["loaded"][n], w) for n, w in base[0]["at_save"].items())  # exact values
    assert max_rel_diff(res["weights"], base[0]["weights"]) < CROSS_TOL


def test_stage1_world1_to_stage3_world2(pool2, tmp_path):
    world1_group()
    base = save_run("layers", 1, str(tmp_path / "ckpt"))
    res = pool2.run("frozen_ckpt_cases:load_run", "layers", 3, str(tmp_path / "ckpt"))
    mean = [(a + b) / 2 for a, b in zip(res[0]["losses"], res[1]["losses"], strict=True)]
    assert mean == pytest.approx(base["losses"][STEPS // 2:], rel=CROSS_TOL)
    assert all(torch.equal(res[0]["loaded"][n], w) for n, w in base["at_save"].items())
    assert max_rel_diff(res[0]["weights"], base["weights"]) < CROSS_TOL


def test_exclude_frozen_parameters(pool2, lora3):
    """Excluded: smaller files, frozen names listed; a load restores the trained parameters, keeps
    the fresh model's frozen ones, and training continues from there."""
    full, excl = lora3["root"] / "full", lora3["root"] / "excl"
    frozen = frozen_param_names("lora")
    meta = _meta(excl)
    assert meta["frozen"] == {} and meta["excluded_frozen"] == sorted(frozen)
    assert _bytes(excl) < _bytes(full) / 5  # the adapters are a small part of the model
    res = pool2.run("frozen_ckpt_cases:load_run", "lora", 3, str(excl))
    fresh, loaded, want = res[0]["fresh"], res[0]["loaded"], lora3["excl"][0]["at_save"]
    for n in want:
        assert torch.equal(loaded[n], fresh[n] if n in frozen else want[n]), n
    assert all(not torch.equal(fresh[n], want[n]) for n in want if want[n].dim() > 1)
    assert all(r["global_steps"] == STEPS for r in res)


def test_strict_refuses_frozen_parameter_neither_saved_nor_excluded(pool2, lora3):
    for ckpt in ("full", "excl"):
        msgs = pool2.run("frozen_ckpt_cases:load_error", "lora", 3, str(lora3["root"] / ckpt), extra_frozen=True)
        for m in msgs:
            assert "CheckpointError" in m and "missing ['extra_frozen']" in m, m
    msgs = pool2.run("frozen_ckpt_cases:load_error", "lora", 3, str(lora3["root"] / "excl"), extra_frozen=True,
                     load_module_strict=False)
    assert msgs == ["no error", "no error"]


def test_zero_to_fp32_and_consolidate_include_frozen(lora3, tmp_path):
    want = lora3["base"][0]["at_save"]
    full, excl = lora3["root"] / "full", lora3["root"] / "excl"
    frozen = set(frozen_param_names("lora"))
    sd = get_fp32_state_dict_from_zero_checkpoint(full)
    assert sd.keys() == want.keys() and all(t.dtype == torch.float32 for t in sd.values())
    assert all(torch.equal(sd[n], want[n]) for n in want)
    assert get_fp32_state_dict_from_zero_checkpoint(full, exclude_frozen_parameters=True).keys() == want.keys() - frozen
    assert get_fp32_state_dict_from_zero_checkpoint(excl).keys() == want.keys() - frozen
    model = load_state_dict_from_zero_checkpoint(make_model("lora", seed=5), excl)  # frozen: the model's own
    fresh = dict(make_model("lora", seed=5).named_parameters())
    assert all(torch.equal(p, fresh[n] if n in frozen else lora3["excl"][0]["at_save"][n])
               for n, p in model.named_parameters())
    consolidate(full, tmp_path / "hf", weights_only=True)
    assert all(torch.equal(t, want[n]) for n, t in load_file(tmp_path / "hf" / "model.safetensors").items())


def test_frozen_layers_consolidate_and_16bit_load_in_hf(pool2, tmp_path):
    """Stage 3 with frozen layers: consolidated and save_16bit_model weights are the engine's."""
    base = pool2.run("frozen_ckpt_cases:save_run", "layers", 3, str(tmp_path / "ckpt"), hf16=str(tmp_path / "hf16"))
    want = base[0]["at_save"]
    consolidate(tmp_path / "ckpt", tmp_path / "hf")
    for folder in ("hf", "hf16"):
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / folder)
        assert all(torch.equal(p, want[n]) for n, p in hf.named_parameters()), folder


@pytest.fixture(scope="module")
def meta1(tmp_path_factory):
    """A world-1 stage-3 checkpoint with frozen layers: (metadata, its path, weights at save)."""
    world1_group()
    root = tmp_path_factory.mktemp("frozen_meta")
    res = save_run("layers", 3, str(root / "ckpt"))
    return _meta(root / "ckpt"), root / "ckpt" / TAG / "metadata.json", res["at_save"]


HOSTILE = {  # the new metadata fields, damaged: refused by the schema before any read
    "dtype": lambda m, k: m["frozen"][k].update(dtype="complex64"),
    "gap": lambda m, k: m["frozen"][k]["segments"][0].update(start=1),
    "file": lambda m, k: m["frozen"][k]["segments"][0].update(file="other.safetensors"),
    "numel": lambda m, k: m["frozen"][k].update(numel=10**15),
    "both": lambda m, k: m["module"].update({k: {"shape": m["frozen"][k]["shape"], "dtype": "float32",
                                                 "tp": None, "file": "rank00000.safetensors"}}),
    "excluded_saved": lambda m, k: m["excluded_frozen"].append(k),
    "excluded_twice": lambda m, k: m["excluded_frozen"].extend(["x", "x"]),
    "order": lambda m, k: m["order"].remove(k),
    "extra_key": lambda m, k: m["frozen"][k].update(master=True),
}


@pytest.mark.parametrize("how", sorted(HOSTILE))
def test_damaged_frozen_metadata_is_refused(meta1, how):
    meta, source, _ = meta1
    bad = json.loads(json.dumps(meta))
    key = sorted(bad["frozen"])[0]
    HOSTILE[how](bad, key)
    parse_metadata(json.loads(json.dumps(meta)), source)  # the undamaged one passes
    with pytest.raises(CheckpointError, match="metadata.json"):
        parse_metadata(bad, source)


def test_format2_checkpoint_with_frozen_in_module_still_loads(tmp_path, meta1):
    """Format 2 kept frozen parameters whole in 'module': rewrite one that way, load it at stage 3."""
    _, source, at_save = meta1
    ckpt = tmp_path / "v2"
    shutil.copytree(source.parent.parent, ckpt)
    name, t = "model.embed_tokens.weight", torch.randn(509, 64)
    save_file({f"module/{name}": t}, ckpt / TAG / "old.safetensors")
    data = (ckpt / TAG / "old.safetensors").read_bytes()
    m = _meta(ckpt)
    del m["frozen"][name]
    m["files"]["old.safetensors"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    m["module"][name] = {"shape": [509, 64], "dtype": "float32", "tp": None, "file": "old.safetensors"}
    (ckpt / TAG / "metadata.json").write_text(json.dumps(m))
    res = load_run("layers", 3, str(ckpt), train=False)
    assert torch.equal(res["loaded"][name], t)
    assert all(torch.equal(res["loaded"][n], w) for n, w in at_save.items() if n != name)
