"""Ulysses sequence parallelism (shardwise/sequence_parallel/): equal to one process on the same data.

Tolerances: a forward/backward is compared at fp32 round-off (1e-5 relative: the all-to-all moves
values exactly, only the order of the two ranks' gradient partial sums and of the loss sum differ;
measured 1e-7 to 4e-7). Training is bounded by tests/tolerance.py's rule from a noise floor measured
here (the same training with per-row forwards and with the MLP units reversed). A wrong SP
(each rank attending only to its half, measured by DeepSpeed's 3e-3..1.7e-2 in loss; gradients 2x)
lands orders of magnitude above either.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import sp_cases  # noqa: E402
from tolerance import equivalence_tol  # noqa: E402

ROUND_OFF = 1e-5


@pytest.mark.parametrize("impl,kv_heads,seq,pad_from,checkpointing", [
    ("sdpa", 1, 16, None, False),  # GQA: one kv head replicated to both ranks
    ("eager", 1, 16, None, False),
    ("sdpa", 2, 15, None, False),  # kv heads split; an odd length padded to the SP degree
    ("sdpa", 1, 16, 9, False),  # right padding removed by the adapter
    ("sdpa", 1, 16, None, True),  # activation checkpointing: the exchanges run again in backward
])
def test_forward_backward_equal_whole_sequence(pool2, impl, kv_heads, seq, pad_from, checkpointing):
    """With checkpointing, also its inputs offloaded (offload_checkpoints): bit-exact against no offload."""
    for r in pool2.run("sp_cases:sp_matches_whole", impl, kv_heads, seq, pad_from, checkpointing):
        assert r["loss"] < ROUND_OFF and r["grad"] < ROUND_OFF, r
        assert r.get("offload_bit_exact", not checkpointing), r
        assert r["cache"] is None, r  # the SP hook turned the KV cache off (the batch holds tensors only)


def _noise(ref: dict, others: list[dict]) -> dict:
    weights = max(float((o["weights"][n] - w).abs().max() / w.abs().max())
                  for o in others for n, w in ref["weights"].items())
    loss = max(abs(a - b) / abs(b) for o in others for a, b in zip(o["losses"], ref["losses"], strict=True))
    norm = max(abs(a - b) / b for o in others for a, b in zip(o["norms"], ref["norms"], strict=True))
    return {"weights": weights, "loss": loss, "norm": norm}


@pytest.fixture(scope="module")
def reference():
    ref = sp_cases.reference_training(dp=1)
    others = [sp_cases.reference_training(dp=1, variant=v) for v in ("rows", "flip")]
    ref["noise"] = _noise(ref, others)
    ref["tol"] = equivalence_tol(ref["noise"], len(sp_cases.SEQS) + len(sp_cases.RESUME_SEQS))
    return ref


def _check(got: dict, ref: dict) -> None:
    tol, steps = ref["tol"], len(got["losses"])
    for a, b in zip(got["losses"], ref["losses"][:steps], strict=True):
        assert abs(a - b) / abs(b) <= tol["loss"], (got["losses"], ref["losses"], tol)
    for a, b in zip(got["norms"], ref["norms"][:steps], strict=True):  # gradients at their true scale (not 2x)
        assert abs(a - b) / b <= tol["norm"], (got["norms"], ref["norms"], tol)
    worst = max(float((got["weights"][n] - w).abs().max() / w.abs().max()) for n, w in ref["weights"].items())
    assert worst <= tol["weights"], (worst, tol)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_sp2_zero_stage_matches_single_process(pool2, reference, stage):
    for got in pool2.run("sp_cases:sp_training", stage, 2):
        assert got["dp_world"] == 1 and got["sp"] == 2
        _check(got, reference)


@pytest.mark.parametrize("inject", ["local", "double"])
def test_injected_sp_errors_fail_the_check(pool2, reference, inject):
    """The bounds above catch SP attending within each rank's half, and gradients at 2x."""
    for got in pool2.run("sp_cases:sp_training", 2, 2, inject=inject):
        with pytest.raises(AssertionError):
            _check(got, reference)


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_saved_under_sp_resumes_without_sp(pool2, reference, stage, tmp_path):
    """Saved at SP 2 after 3 steps, loaded by a plain data-parallel engine: the next steps' losses
    are the single-process run's (weights and Adam moments came back; the format is layout-free).
    The checkpoint consolidates offline (`shardwise consolidate`) into an HF folder that loads with the
    engine's weights bit for bit and the model's own attention (not the SP registration's name), and
    generates the tokens a model holding the engine's weights generates."""
    import torch
    from transformers import AutoModelForCausalLM

    from shardwise.checkpoint import consolidate

    ckpt = tmp_path / "ckpt"
    trained = pool2.run("sp_cases:sp_training", stage, 2, save_dir=str(ckpt))[0]["weights"]
    first = len(sp_cases.SEQS)
    for got in pool2.run("sp_cases:resume_without_sp", stage, str(ckpt)):
        for a, b in zip(got["losses"], reference["losses"][first:], strict=True):
            assert abs(a - b) / abs(b) <= reference["tol"]["loss"], (got["losses"], reference["losses"])
    consolidate(str(ckpt), str(tmp_path / "hf"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), trained[n]), n
    live = sp_cases.llama()
    live.load_state_dict(trained)
    prompt = torch.tensor([[5, 17, 3, 250, 41]])
    new = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False}
    got = model.eval().generate(prompt, **new)
    assert torch.equal(got, live.eval().generate(prompt, **new)) and got.shape[1] == 13


def test_sp2_x_dp2_four_ranks(pool4):
    """SP groups {0,1} {2,3}, each reading its own samples, at stage 2 (ZeRO over all 4 ranks) and at
    stage 3 with hybrid sharding (shard groups {0,1} {2,3}, replicas {0,2} {1,3}): equal to one process
    averaging the two replicas' losses."""
    ref = sp_cases.reference_training(dp=2)
    others = [sp_cases.reference_training(dp=2, variant=v) for v in ("rows", "flip")]
    ref["tol"] = equivalence_tol(_noise(ref, others), len(sp_cases.SEQS) + len(sp_cases.RESUME_SEQS))
    for stage, zero in ((2, {}), (3, {"mics_shard_size": 2})):
        for got in pool4.run("sp_cases:sp_training", stage, 2, **zero):
            assert got["dp_world"] == 2 and got["sp"] == 2
            _check(got, ref)


def test_tp2_x_sp2_four_ranks(pool4, pool2, tmp_path):
    """TP 2 x SP 2: TP groups {0,1} {2,3}, SP groups {0,2} {1,3} (the ranks with the same TP rank),
    ZeRO over the same {0,2} {1,3}. 4 heads and 2 kv heads: 2 and 1 per TP rank, the kv head copied
    to both SP ranks. At stage 3, and at stage 2 with tiled MLPs (their TP all-reduces run per tile,
    again in backward), equal to one process on the same global data; the stage-3 checkpoint
    resumes on 2 plain data-parallel ranks (no TP, no SP) with the reference's losses."""
    ref = sp_cases.reference_training(dp=1, kv_heads=2)
    others = [sp_cases.reference_training(dp=1, variant=v, kv_heads=2) for v in ("rows", "flip")]
    ref["tol"] = equivalence_tol(_noise(ref, others), len(sp_cases.SEQS) + len(sp_cases.RESUME_SEQS))
    for stage, more in ((2, {"tiles": 3, "tiled_loss": False}), (3, {"save_dir": str(tmp_path)})):
        for rank, got in enumerate(pool4.run("sp_cases:sp_training", stage, 2, tp=2, kv_heads=2, **more)):
            assert got["dp_world"] == 1 and got["sp"] == 2 and got["sp_ranks"] == [rank % 2, rank % 2 + 2]
            _check(got, ref)
    first = len(sp_cases.SEQS)
    for got in pool2.run("sp_cases:resume_without_sp", 3, str(tmp_path), kv_heads=2):
        for a, b in zip(got["losses"], ref["losses"][first:], strict=True):
            assert abs(a - b) / abs(b) <= ref["tol"]["loss"], (got["losses"], ref["losses"])
    for words in pool4.run("sp_cases:facade_sp_with_tp_refused"):  # its mpu's groups were cut without TP
        assert "register_with_transformers' sequence parallelism with tensor_parallel" in words, words


@pytest.mark.parametrize("heads,kv,sp,tp,copies_or_words", [
    (8, 4, 2, 2, 1),  # 4 heads, 2 kv heads per TP rank: the kv heads split over SP 2
    (8, 4, 4, 2, 2),  # 4 and 2 per TP rank: each kv head copied to 2 SP ranks
    (8, 8, 4, 4, "2 attention heads per tensor-parallel rank \\(8 and 8 over tensor parallel 4\\) cannot"),
    (12, 6, 2, 2, "3 key/value heads per tensor-parallel rank"),  # 6 kv heads split over SP 2; 3 do not
])
def test_head_counts_under_tensor_parallelism(heads, kv, sp, tp, copies_or_words):
    from shardwise.sequence_parallel import head_split

    if isinstance(copies_or_words, int):
        assert head_split(heads, kv, sp, tp) == copies_or_words
    else:
        with pytest.raises(ValueError, match=copies_or_words):
            head_split(heads, kv, sp, tp)


def test_sp_groups_cut_without_tp_refused_on_a_tp_model(monkeypatch):
    """Groups of consecutive ranks on a TP-split model would exchange heads between TP ranks: refused
    when registering on a split model, and at the first forward when TP was applied afterwards."""
    from types import SimpleNamespace

    from shardwise.sequence_parallel import SequenceParallel, attention, group, register_attention

    monkeypatch.setattr(attention, "_CURRENT", {})  # the fake group leaves no process-wide trace
    monkeypatch.setattr(group, "_CURRENT", [])
    words = "split over tensor parallel 2 but the SP groups were cut for tensor parallel 1"
    split = SimpleNamespace(comm=SimpleNamespace(size=2))
    sp = SequenceParallel(SimpleNamespace(sp=SimpleNamespace(size=2, rank=0), tp_size=1))
    model = sp_cases.llama(kv_heads=2)
    monkeypatch.setattr(attention, "tp_state_of", lambda m: split)
    with pytest.raises(ValueError, match=words):
        register_attention(model, sp)
    monkeypatch.setattr(attention, "tp_state_of", lambda m: None)
    register_attention(model, sp)  # not split yet: accepted
    monkeypatch.setattr(attention, "tp_state_of", lambda m: split)  # then split, as shard(tp_plan=...) does
    with pytest.raises(ValueError, match=words):
        model(**split_batch_of(sp))


def split_batch_of(sp) -> dict:
    from shardwise.sequence_parallel import split_batch

    shard = split_batch(sp_cases.sample_batch(1, 8), sp)
    shard.pop("shift_labels")
    return shard


def test_eval_mode_keeps_sp_generate_is_local_unsplit_refused(pool2):
    for r in pool2.run("sp_cases:eval_mode_keeps_sp_and_generate_is_local"):
        assert r["loss"] < ROUND_OFF, r
        assert r["generate_equal"], r
        assert r["unsplit"] is not None and "no position_ids" in r["unsplit"], r


def test_unequal_shards_refused_on_every_rank_then_a_new_length_trains(pool2):
    for r in pool2.run("sp_cases:unequal_shards_refused_then_new_length"):
        assert r["refused"] is not None and "differ in length (6..8 tokens)" in r["refused"], r
        assert r["loss"] < ROUND_OFF, r


@pytest.mark.parametrize("heads,kv,sp,words", [
    (3, 3, 2, "3 attention heads cannot be split over 2 ranks"),
    (6, 3, 2, "3 key/value heads cannot be split over or replicated to 2 ranks"),
    (8, 2, 8, None), (8, 4, 2, None),
])
def test_head_counts(heads, kv, sp, words):
    from shardwise.sequence_parallel import head_split

    if words is None:
        assert head_split(heads, kv, sp) == max(1, sp // kv)
    else:
        with pytest.raises(ValueError, match=words):
            head_split(heads, kv, sp)


def test_split_batch_refuses_left_padding_and_keeps_edge_targets():
    import torch

    from shardwise.sequence_parallel import split_batch

    class Half:  # an SP group of 2 seen from rank 0 / rank 1, without processes
        size = 2

        def __init__(self, rank):
            self.rank = rank

    ids = torch.arange(10, 17).reshape(1, 7)
    shards = [split_batch({"input_ids": ids, "labels": ids}, Half(r)) for r in (0, 1)]
    assert shards[0]["input_ids"].tolist() == [[10, 11, 12, 13]]
    assert shards[1]["input_ids"].tolist() == [[14, 15, 16, 0]]
    assert shards[0]["shift_labels"].tolist() == [[11, 12, 13, 14]]  # 14 lives on rank 1: its target kept
    assert shards[1]["shift_labels"].tolist() == [[15, 16, -100, -100]]
    assert shards[1]["position_ids"].tolist() == [[4, 5, 6, 7]]
    # DeepSpeed's contract: tensors only, so the usual `{k: v.to(device) for k, v in batch.items()}` runs
    assert all(set(s) == {"input_ids", "position_ids", "shift_labels"} for s in shards), [set(s) for s in shards]
    assert {k: v.to("cpu") for k, v in shards[0].items()}.keys() == shards[0].keys()
    with pytest.raises(ValueError, match="only right padding"):
        split_batch({"input_ids": ids, "attention_mask": torch.tensor([[0, 1, 1, 1, 1, 1, 1]])}, Half(0))


# -- ALST's tiled pieces ------------------------------------------------------------------------------
TILED_ROUND_OFF = 1e-5  # same per-token math; only matmul shapes and the tile-by-tile gradient sums differ


def _loss_and_grads(model, batch, tiled_loss: bool, scale: float):
    import torch

    from shardwise.sequence_parallel import tiled_causal_lm_loss

    if tiled_loss:
        labels = torch.cat([batch["labels"][:, 1:], torch.full_like(batch["labels"][:, :1], -100)], dim=1)
        loss = tiled_causal_lm_loss(model, {"input_ids": batch["input_ids"]}, labels, tiles=3)
    else:
        loss = model(**batch).loss
    (loss * scale).backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mlp,loss", [(True, False), (False, True), (True, True)])
def test_tiled_pieces_equal_untiled_with_a_scaled_loss(mlp, loss):
    """Tiles of 6, 5, 5 tokens; the loss is scaled by 3 before backward (DeepSpeed's TiledFusedLogitsLoss
    drops such a scale from the LM head's gradient): every gradient, the head's included, is 3x."""
    import copy

    from shardwise.sequence_parallel import tile_mlps

    model = sp_cases.llama()
    tiled = copy.deepcopy(model)
    if mlp:
        assert tile_mlps(tiled, tiles=3) == 2
    batch = sp_cases.sample_batch(2, 16, pad_from=9)
    want_loss, want = _loss_and_grads(model, batch, False, 3.0)
    got_loss, got = _loss_and_grads(tiled, batch, loss, 3.0)
    assert abs(got_loss - want_loss) / want_loss < TILED_ROUND_OFF
    for n, g in want.items():
        assert float((got[n] - g).norm() / g.norm()) < TILED_ROUND_OFF, n


@pytest.mark.parametrize("stage", [2, 3])
def test_sp2_with_tiled_pieces_matches_single_process(pool2, reference, stage):
    for got in pool2.run("sp_cases:sp_training", stage, 2, tiles=3):
        _check(got, reference)


@pytest.mark.parametrize("stage", [1, 3])
def test_sp2_with_shard_api_matches_single_process(pool2, reference, stage):
    """shardwise.shard() + ShardedOptimizer average over every rank, as the engine does: SP needs nothing more."""
    for got in pool2.run("sp_cases:sp_shard_api", stage):
        _check(got, reference)


def test_register_with_transformers_refusals():
    """The facade's entry refuses, in one line, what it cannot serve; size 1 is a no-op (DeepSpeed's)."""
    from shardwise.deepspeed.ulysses import UlyssesSPAttentionHF

    reg = UlyssesSPAttentionHF.register_with_transformers
    assert reg(sp_cases.llama(), "sdpa", 1, 1) is None
    with pytest.raises(ValueError, match="needs the model object"):
        reg("meta-llama/Llama-3.1-8B", "sdpa", 2, 1)
    with pytest.raises(ValueError, match="does not match the model's attn_implementation 'sdpa'"):
        reg(sp_cases.llama(), "eager", 2, 1)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_facade_tiled_names_equal_untiled(reduction):
    """DeepSpeed's TiledMLP / TiledFusedLogitsLoss signatures (the facade) on a Llama: values and every
    gradient equal the untiled computation, with the output scaled by 0.5 before backward ("mean"
    averages the 3 tiles' losses: tiles of equal size here, 10 rows each, so it is the untiled mean)."""
    import copy

    import torch
    import torch.nn.functional as F

    from shardwise.deepspeed.ulysses import TiledFusedLogitsLoss, TiledMLP

    def mlp_fn(module, x):
        return type(module).forward(module, x)

    def loss_fn(head, x, y):
        return F.cross_entropy(head(x).float(), y, reduction=reduction)

    def run(model, tiled):
        ids = sp_cases.sample_batch(2, 15)["input_ids"]
        labels = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
        if tiled:
            for layer in model.model.layers:
                mlp = layer.mlp
                mlp.forward = lambda x, m=mlp: TiledMLP.apply(mlp_fn, m, x, 3, list(m.parameters()))
        hidden = model.model(input_ids=ids).last_hidden_state
        head = model.lm_head
        if tiled:
            loss = TiledFusedLogitsLoss.apply(loss_fn, head, hidden, labels, None, 3, [head.weight], reduction)
        else:
            loss = F.cross_entropy(head(hidden).float().reshape(-1, sp_cases.VOCAB), labels.reshape(-1),
                                   reduction="sum")
            loss = loss / 3 / 10 if reduction == "mean" else loss
        (loss * 0.5).backward()
        return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}

    model = sp_cases.llama()
    want_loss, want = run(copy.deepcopy(model), False)
    got_loss, got = run(model, True)
    assert abs(got_loss - want_loss) / abs(want_loss) < TILED_ROUND_OFF
    for n, g in want.items():
        assert float((got[n] - g).norm() / g.norm()) < TILED_ROUND_OFF, n


def test_sliding_windows_and_sinks_are_refused_not_dropped(pool2):
    # the whole-sequence causal attention would ignore a window shorter than the sequence and the
    # per-head sinks: refused in one line; a window as long as the sequence masks nothing and runs
    for short, whole, sinks in pool2.run("sp_cases:refused_windows_and_sinks"):
        assert "sliding window of 12 tokens, shorter than the 16-token sequence" in short and "\n" not in short
        assert whole == "ran"
        assert "GptOssAttention has attention sinks" in sinks and "\n" not in sinks
