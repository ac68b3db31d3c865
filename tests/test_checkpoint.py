"""Sharded checkpoints: exact resume across layouts, HF export, damaged files, crashed saves."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from ckpt_cases import STEPS, probe_ids
from transformers import AutoModelForCausalLM
from zero_cases import max_rel_diff

from shardwise.checkpoint import CheckpointError, consolidate
from shardwise.cli.consolidate import main as consolidate_main

KIND = "llama"
CROSS_TOL = 1e-6


@pytest.fixture(scope="module")
def baseline(pool2, tmp_path_factory):
    """Stage 2, world 2: STEPS uninterrupted steps, checkpoint + HF export taken halfway."""
    root = tmp_path_factory.mktemp("ckpt")
    res = pool2.run("ckpt_cases:train_and_save", KIND, 2, str(root / "ckpt"), str(root / "hf16"))
    return {"res": res, "ckpt": root / "ckpt", "hf16": root / "hf16", "root": root}


def _mean_losses(res) -> list[float]:
    return [sum(r["losses"][i] for r in res) / len(res) for i in range(len(res[0]["losses"]))]


def test_layout_independent_metadata(baseline):
    meta = json.loads((baseline["ckpt"] / "global_step2" / "metadata.json").read_text())
    assert meta["layout"] == {"world": 2, "dp": 2, "tp": 1, "stage": 2, "compute_dtype": "float32"}
    assert meta["states"] == ["exp_avg", "exp_avg_sq"] and set(meta["files"]) == {
        "rank00000.safetensors", "rank00001.safetensors"}
    emb = meta["tensors"]["model.embed_tokens.weight"]
    assert emb["shape"] == [509, 64] and emb["tp"] is None
    assert sum(s["stop"] - s["start"] for s in emb["segments"]) == emb["numel"]
    assert meta["scalars"]["model.embed_tokens.weight"]["step"]["value"] == 2
    assert (baseline["ckpt"] / "latest").read_text() == "global_step2"
    assert not list(baseline["ckpt"].glob(".*"))  # no temp folder left behind


def test_resume_same_layout_is_bitwise_identical(pool2, baseline):
    res = pool2.run("ckpt_cases:load_and_train", KIND, 2, str(baseline["ckpt"]))
    base = baseline["res"]
    for r in range(2):
        assert res[r]["losses"] == base[r]["losses"][STEPS // 2:]
        assert res[r]["lr"] == base[r]["lr"] and res[r]["global_steps"] == STEPS
    assert res[0]["client_state"] == {"epoch": 3, "note": "halfway", "seen": [1, 2]}
    assert all(torch.equal(res[0]["weights"][k], w) for k, w in base[0]["weights"].items())


@pytest.mark.parametrize(("stage", "bucket"), [(1, 5_000), (0, 20_000), (3, 20_000)])
def test_resume_other_stage_and_bucketing(pool2, baseline, tmp_path, stage, bucket):
    res = pool2.run("ckpt_cases:load_and_train", KIND, stage, str(baseline["ckpt"]), bucket,
                    save_to=str(tmp_path / "again"))
    base = baseline["res"]
    for r in range(2):
        assert res[r]["losses"] == pytest.approx(base[r]["losses"][STEPS // 2:], rel=CROSS_TOL)
    assert max_rel_diff(res[0]["weights"], base[0]["weights"]) < CROSS_TOL
    meta = json.loads((tmp_path / "again" / f"global_step{STEPS}" / "metadata.json").read_text())
    want = {"rank00000.safetensors"} if stage == 0 else {"rank00000.safetensors", "rank00001.safetensors"}
    assert set(meta["files"]) == want  # stage 0 is replicated: only rank 0 writes state
    consolidate(tmp_path / "again", tmp_path / "hf")  # what this layout saved is what it trained
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert all(torch.equal(p, res[0]["weights"][n]) for n, p in hf.named_parameters())


def test_resume_on_four_ranks(pool4, baseline):
    res = pool4.run("ckpt_cases:load_and_train", KIND, 2, str(baseline["ckpt"]))
    base = baseline["res"]
    assert _mean_losses(res) == pytest.approx(_mean_losses(base)[STEPS // 2:], rel=CROSS_TOL)
    assert max_rel_diff(res[0]["weights"], base[0]["weights"]) < CROSS_TOL


def test_load_module_only_keeps_fresh_optimizer(pool2, baseline):
    res = pool2.run("ckpt_cases:load_and_train", KIND, 2, str(baseline["ckpt"]), load_module_only=True)
    assert res[0]["start"] == 0 and res[0]["client_state"]["epoch"] == 3  # counters not restored


def _hf_logits(folder, **kw) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", **kw)
    with torch.no_grad():
        return model(input_ids=probe_ids()).logits.float()


def test_consolidated_weights_match_engine_logits(baseline, tmp_path):
    want = baseline["res"][0]["logits_at_save"]
    consolidate(baseline["ckpt"], tmp_path / "one")
    torch.testing.assert_close(_hf_logits(tmp_path / "one"), want, rtol=0, atol=1e-5)
    # sharded output through the CLI entry point, in bf16
    rc = consolidate_main([str(baseline["ckpt"]), str(tmp_path / "many"), "--tag", "global_step2",
                           "--dtype", "bf16", "--max-shard-size", "50KB"])
    assert rc == 0
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert json.loads((tmp_path / "many" / "config.json").read_text())["dtype"] == "bfloat16"
    got = _hf_logits(tmp_path / "many", dtype=torch.bfloat16)
    assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_save_16bit_model_matches_engine_logits(baseline):
    want = baseline["res"][0]["logits_at_save"]
    torch.testing.assert_close(_hf_logits(baseline["hf16"]), want, rtol=0, atol=1e-5)


def _damaged_copy(baseline, tmp_path, how: str):
    dst = tmp_path / "ckpt"
    shutil.copytree(baseline["ckpt"], dst)
    victim = dst / "global_step2" / "rank00001.safetensors"
    data = bytearray(victim.read_bytes())
    if how == "corrupt":
        data[len(data) // 2: len(data) // 2 + 16] = bytes(16)
    else:
        data = data[: len(data) - 1000]
    victim.write_bytes(bytes(data))
    return dst


@pytest.mark.parametrize("how", ["corrupt", "truncated"])
def test_damaged_shard_is_refused_by_name(pool2, baseline, tmp_path, how):
    dst = _damaged_copy(baseline, tmp_path, how)
    msgs = pool2.run("ckpt_cases:load_error", KIND, str(dst))
    for m in msgs:  # every rank fails (none is left waiting in a collective), naming the file
        assert "rank00001.safetensors" in m, m
        assert ("sha256 mismatch" if how == "corrupt" else "truncated") in m
    with pytest.raises(CheckpointError, match="rank00001.safetensors"):
        consolidate(dst, tmp_path / "out")
    assert consolidate_main([str(dst), str(tmp_path / "out")]) == 2  # a user error


def test_crash_during_save_keeps_previous_checkpoint(pool2, tmp_path):
    out = pool2.run("ckpt_cases:crash_during_save", KIND, str(tmp_path / "ckpt"))
    for o in out:
        assert "simulated crash after writing rank00000.safetensors" in o["save"], o["save"]
        assert "not JSON-serializable" in o["client_state"] and "client_state['bad']" in o["client_state"]
        assert o["path"].endswith("good") and o["restored"] and o["global_steps"] == 1
    assert (tmp_path / "ckpt" / "latest").read_text() == "good"
    assert not (tmp_path / "ckpt" / "bad").exists()


def test_bf16_offload_resume_across_stages(pool2, tmp_path):
    """Separate fp32 masters (bf16 params, CPU-offloaded optimizer): stage 1 -> stage 2 without offload."""
    base = pool2.run("ckpt_cases:train_and_save", KIND, 1, str(tmp_path / "ckpt"), str(tmp_path / "hf"),
                     precision="bf16", offload=True)
    res = pool2.run("ckpt_cases:load_and_train", KIND, 2, str(tmp_path / "ckpt"), cfg_kw={"precision": "bf16"})
    for r in range(2):
        assert res[r]["losses"] == pytest.approx(base[r]["losses"][STEPS // 2:], rel=CROSS_TOL)
    assert all(torch.equal(res[0]["weights"][k], w) for k, w in base[0]["weights"].items())
    meta = json.loads((tmp_path / "ckpt" / "global_step2" / "metadata.json").read_text())
    assert meta["tensors"]["lm_head.weight"]["dtype"] == "bfloat16"
    assert meta["layout"]["compute_dtype"] == "bfloat16"


# -- tensor parallelism: TP pieces saved as NAME@tp{r}of{t}, resharded on load ----------------------
TP_TOL = 1e-5


@pytest.fixture(scope="module")
def tp_baseline(pool2, tmp_path_factory):
    """TP=2 (dp 1, stage 0): STEPS uninterrupted steps, checkpoint + HF export taken halfway."""
    root = tmp_path_factory.mktemp("ckpt_tp")
    res = pool2.run("ckpt_cases:train_and_save", KIND, 0, str(root / "ckpt"), str(root / "hf16"), tp=2)
    return {"res": res, "ckpt": root / "ckpt", "hf16": root / "hf16"}


def test_tp_metadata_names_pieces(tp_baseline):
    meta = json.loads((tp_baseline["ckpt"] / "global_step2" / "metadata.json").read_text())
    assert meta["version"] == 3 and meta["layout"] == {"world": 2, "dp": 1, "tp": 2, "stage": 0,
                                                       "compute_dtype": "float32"}
    t = meta["tensors"]
    emb = t["model.embed_tokens.weight@tp1of2"]  # vocab 509 padded to 510: 255 rows per rank
    assert emb["shape"] == [255, 64] and "model.embed_tokens.weight" not in t
    assert emb["tp"] == {"param": "model.embed_tokens.weight", "dim": 0, "full": 509, "size": 2, "rank": 1,
                         "parts": 1, "full_shape": [509, 64]}
    assert t["model.layers.0.self_attn.o_proj.weight@tp0of2"]["tp"]["dim"] == 1
    norm = t["model.norm.weight"]  # replicated: saved once, by TP rank 0
    assert norm["tp"] is None and {s["file"] for s in norm["segments"]} == {"rank00000.safetensors"}
    assert {s["file"] for s in emb["segments"]} == {"rank00001.safetensors"}
    assert meta["order"][0] == "model.embed_tokens.weight" and "@" not in "".join(meta["order"])


def test_tp2_to_tp1_dp2_resume(pool2, tp_baseline):
    """TP=2 checkpoint -> TP=1 x dp=2, stage 2: continues as the uninterrupted TP=2 run."""
    res = pool2.run("ckpt_cases:load_and_train", KIND, 2, str(tp_baseline["ckpt"]))
    base = tp_baseline["res"]
    assert _mean_losses(res) == pytest.approx(base[0]["losses"][STEPS // 2:], rel=TP_TOL)
    assert res[0]["global_steps"] == STEPS and res[0]["lr"] == base[0]["lr"]
    assert max_rel_diff(res[0]["weights"], base[0]["weights"]) < TP_TOL


def test_tp2_to_tp2_resume_reads_own_pieces(pool2, tp_baseline):
    res = pool2.run("ckpt_cases:load_and_train", KIND, 2, str(tp_baseline["ckpt"]), cfg_kw={"tp": 2})
    base = tp_baseline["res"]
    assert res[0]["losses"] == pytest.approx(base[0]["losses"][STEPS // 2:], rel=TP_TOL)
    assert max_rel_diff(res[0]["weights"], base[0]["weights"]) < TP_TOL


def test_tp1_to_tp2_resume(pool2, baseline):
    """The stage-2 dp=2 checkpoint -> TP=2 (dp 1, stage 0): continues as the uninterrupted run."""
    res = pool2.run("ckpt_cases:load_and_train", KIND, 0, str(baseline["ckpt"]), cfg_kw={"tp": 2})
    base = baseline["res"]
    assert res[0]["losses"] == pytest.approx(_mean_losses(base)[STEPS // 2:], rel=TP_TOL)
    assert max_rel_diff(res[0]["weights"], base[0]["weights"]) < TP_TOL


def test_tp_consolidate_and_16bit_match_engine_logits(tp_baseline, tmp_path):
    want = tp_baseline["res"][0]["logits_at_save"]
    assert want.shape[-1] == 509  # gathered, padding trimmed
    consolidate(tp_baseline["ckpt"], tmp_path / "hf")
    torch.testing.assert_close(_hf_logits(tmp_path / "hf"), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(_hf_logits(tp_baseline["hf16"]), want, rtol=0, atol=1e-5)


def test_gpt2_tied_tp2_to_tp1(pool2, tmp_path):
    """GPT-2 (tied head, fused q|k|v cut in 3 parts, vocab 509) TP=2 stage 2 -> TP=1 dp=2."""
    base = pool2.run("ckpt_cases:train_and_save", "gpt2", 2, str(tmp_path / "ckpt"), str(tmp_path / "hf16"),
                     tp=2)
    res = pool2.run("ckpt_cases:load_and_train", "gpt2", 2, str(tmp_path / "ckpt"))
    assert _mean_losses(res) == pytest.approx(base[0]["losses"][STEPS // 2:], rel=TP_TOL)
    assert max_rel_diff(res[0]["weights"], base[0]["weights"]) < TP_TOL
    meta = json.loads((tmp_path / "ckpt" / "global_step2" / "metadata.json").read_text())
    assert meta["tensors"]["transformer.h.0.attn.c_attn.weight@tp0of2"]["tp"]["parts"] == 3
    consolidate(tmp_path / "ckpt", tmp_path / "hf")
    want = base[0]["logits_at_save"]
    torch.testing.assert_close(_hf_logits(tmp_path / "hf"), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(_hf_logits(tmp_path / "hf16"), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("dim", "parts", "src", "dst"), [(0, 1, 2, 4), (0, 1, 4, 1), (1, 3, 2, 1),
                                                          (1, 3, 1, 2), (1, 1, 2, 2)])
def test_rebuild_reshards_pieces(dim, parts, src, dst):
    """Any saved degree -> any target degree, padded vocab rows (509) and fused parts included."""
    from ckpt_cases import tp_pieces

    from shardwise.checkpoint.tp import rebuild
    from shardwise.tensor_parallel import ShardSpec

    full = torch.randn(509, 12) if dim == 0 else torch.randn(4, 12)
    if src == 1:
        entries, data = {"w": {"shape": list(full.shape), "numel": full.numel(), "tp": None}}, {"w": full}
    else:
        entries, data = tp_pieces(full, dim, src, parts)
    read = []

    def load(k):
        read.append(k)
        return data[k]

    for r in range(dst):
        spec = ShardSpec(dim, full.shape[dim], dst, r, parts) if dst > 1 else None
        want = spec.take(full) if spec else full
        read.clear()
        got = rebuild("w", torch.zeros_like(want), spec, sorted(entries), entries, load)
        assert torch.equal(got, want)
        if src == 4 and dst == 1:
            assert len(read) == 4
        if (src, dst) == (2, 4) and r in (0, 3):  # rows [0, 128) / [384, 509): inside one saved piece
            assert read == [f"w@tp{r // 2}of2"]  # only the overlapping piece is read


def test_rebuild_refuses_other_split_dim():
    from ckpt_cases import tp_pieces

    from shardwise.checkpoint.tp import rebuild
    from shardwise.tensor_parallel import ShardSpec

    entries, data = tp_pieces(torch.randn(8, 6), 0, 2)
    with pytest.raises(CheckpointError, match="split along dim 0, this model splits it along dim 1"):
        rebuild("w", torch.zeros(8, 3), ShardSpec(1, 6, 2, 0), sorted(entries), entries, data.__getitem__)
    del entries["w@tp1of2"]
    with pytest.raises(CheckpointError, match="not ranks 0..1"):
        rebuild("w", torch.zeros(8, 6), None, sorted(entries), entries, data.__getitem__)


def test_tp_frozen_sharded_embedding(pool2, tmp_path):
    """A frozen vocab-parallel embedding is saved as frozen TP pieces and resharded on load."""
    base = pool2.run("ckpt_cases:train_and_save", KIND, 2, str(tmp_path / "ckpt"), str(tmp_path / "hf16"),
                     tp=2, freeze="embed_tokens")
    res = pool2.run("ckpt_cases:load_and_train", KIND, 2, str(tmp_path / "ckpt"), freeze="embed_tokens")
    assert _mean_losses(res) == pytest.approx(base[0]["losses"][STEPS // 2:], rel=TP_TOL)
    assert max_rel_diff(res[0]["weights"], base[0]["weights"]) < TP_TOL
    meta = json.loads((tmp_path / "ckpt" / "global_step2" / "metadata.json").read_text())
    assert meta["frozen"]["model.embed_tokens.weight@tp1of2"]["tp"]["rank"] == 1
    consolidate(tmp_path / "ckpt", tmp_path / "hf")
    torch.testing.assert_close(_hf_logits(tmp_path / "hf"), base[0]["logits_at_save"], rtol=0, atol=1e-5)


def test_tp2_dp2_stage3_to_tp1(pool4, pool2, tmp_path):
    """TP=2 x dp=2 at stage 3 (4 ranks) -> TP=1, stage 3 on 2 ranks; consolidates to the engine's logits."""
    base = pool4.run("ckpt_cases:train_and_save", KIND, 3, str(tmp_path / "ckpt"), str(tmp_path / "hf16"), tp=2)
    res = pool2.run("ckpt_cases:load_and_train", KIND, 3, str(tmp_path / "ckpt"))
    assert _mean_losses(res) == pytest.approx(_mean_losses(base)[STEPS // 2:], rel=TP_TOL)
    assert max_rel_diff(res[0]["weights"], base[0]["weights"]) < TP_TOL
    consolidate(tmp_path / "ckpt", tmp_path / "hf")
    torch.testing.assert_close(_hf_logits(tmp_path / "hf"), base[0]["logits_at_save"], rtol=0, atol=1e-5)
    torch.testing.assert_close(_hf_logits(tmp_path / "hf16"), base[0]["logits_at_save"], rtol=0, atol=1e-5)
