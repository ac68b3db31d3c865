"""Ring attention (shardwise/sequence_parallel/ring.py): equal to one process on the same data.

Tolerances as in tests/test_sequence_parallel.py. The kernel and one model forward + backward are
compared at fp32 round-off (1e-5 relative: the online-softmax merge is exact in real arithmetic;
only the order of the block sums and of fp32 exp/log differs; measured 1e-7 to 5e-7). Training is
bounded by tests/tolerance.py's rule from a noise floor measured here on the same 3-head model.
A merge that loses one key/value block is off by O(1) (measured 0.5 to 12 relative), and each rank
attending only to its own shard is caught by the training bound.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import sp_cases  # noqa: E402
from test_sequence_parallel import _check, _noise  # noqa: E402
from tolerance import equivalence_tol  # noqa: E402

ROUND_OFF = 1e-5
HEADS = 3  # Ulysses cannot split 3 query heads (and 1 kv head) over 2 ranks: "auto" picks the ring


@pytest.mark.parametrize("causal,seq,heads,kv_heads,layout", [
    (True, 12, 3, 1, "zigzag"),  # GQA 3:1, the load-balanced layout (chunks of 3: pairs wholly visible,
    (False, 12, 3, 1, "zigzag"),  # wholly masked and diagonal)
    (True, 12, 4, 2, "contiguous"),
])
def test_ring_kernel_equals_plain_attention(pool2, causal, seq, heads, kv_heads, layout):
    """Output and q/k/v gradients of each rank's tokens against sdpa over the whole sequence."""
    for errors in pool2.run("ring_cases:ring_matches_plain", causal, seq, heads, kv_heads, layout):
        assert max(errors.values()) < ROUND_OFF, errors


def test_ring_kernel_sp4_beyond_the_head_count(pool4):
    """4 ranks, 2 query heads and 1 kv head (an SP degree Ulysses cannot reach), 24 tokens in 2N = 8
    chunks of 3: every rank's k/v travel three hops (the ring's direction matters, unlike at 2 ranks),
    their gradients four, back home."""
    for errors in pool4.run("ring_cases:ring_matches_plain", True, 24, 2, 1):
        assert max(errors.values()) < ROUND_OFF, errors


def test_ring_kernel_check_catches_a_dropped_block(pool2):
    """The same comparison with the block received after the first rotation left out of the merge."""
    for errors in pool2.run("ring_cases:ring_matches_plain", True, 12, 3, 1, inject="drop"):
        assert errors["out"] > 1e3 * ROUND_OFF, errors


@pytest.mark.parametrize("impl,kv_heads,seq,pad_from,checkpointing,heads,attention", [
    ("sdpa", 1, 15, None, False, HEADS, "auto"),  # an odd length, padded to a multiple of 2N chunks
    ("eager", 1, 16, 9, False, HEADS, "auto"),  # right padding; eager's local mask replaced by the global one
    ("sdpa", 2, 16, 9, True, 4, "ring"),  # asked for by name; recomputed under activation checkpointing
])
def test_ring_forward_backward_equals_whole_sequence(pool2, impl, kv_heads, seq, pad_from, checkpointing, heads,
                                                     attention):
    for r in pool2.run("sp_cases:sp_matches_whole", impl, kv_heads, seq, pad_from, checkpointing, heads, attention):
        assert r["attention"] == "ring", r
        assert r["loss"] < ROUND_OFF and r["grad"] < ROUND_OFF, r


def test_ring_refuses_shards_not_in_its_layout(pool2):
    """Contiguous shards given to a ring-attention model would be masked as the wrong tokens: refused."""
    for message in pool2.run("ring_cases:contiguous_shards_refused"):
        assert message.startswith("ring attention: rank ") and "zigzag shard" in message, message


@pytest.fixture(scope="module")
def reference():
    ref = sp_cases.reference_training(dp=1, heads=HEADS)
    others = [sp_cases.reference_training(dp=1, variant=v, heads=HEADS) for v in ("rows", "flip")]
    ref["tol"] = equivalence_tol(_noise(ref, others), len(sp_cases.SEQS) + len(sp_cases.RESUME_SEQS))
    return ref


@pytest.mark.parametrize("stage", [2, 3])
def test_ring_sp2_zero_stage_matches_single_process(pool2, reference, stage):
    """HF Llama (sdpa) with 3 heads and 1 kv head at SP 2: the default mode picks the ring; losses,
    gradient norms and weights equal the single-process run (lengths 16, 13, 11, right padding)."""
    for got in pool2.run("sp_cases:sp_training", stage, 2, heads=HEADS):
        assert got["attention"] == "ring" and got["sp"] == 2
        _check(got, reference)


def test_ring_training_check_catches_local_attention(pool2, reference):
    for got in pool2.run("sp_cases:sp_training", 2, 2, heads=HEADS, inject="local"):
        with pytest.raises(AssertionError):
            _check(got, reference)


@pytest.mark.parametrize("mode,heads,kv,sp,want", [
    ("auto", 4, 1, 2, "ulysses"), ("auto", 3, 1, 2, "ring"), ("auto", 6, 3, 2, "ring"),
    ("auto", 8, 2, 16, "ring"),  # an SP degree beyond the head count
    ("ring", 4, 2, 2, "ring"), ("ulysses", 4, 2, 2, "ulysses"),
    ("ulysses", 3, 1, 2, "3 attention heads cannot be split over 2 ranks"),
    ("bogus", 4, 1, 2, "must be one of"),
])
def test_choose_attention(mode, heads, kv, sp, want):
    from shardwise.sequence_parallel import choose_attention

    if want in ("ulysses", "ring"):
        assert choose_attention(mode, heads, kv, sp) == want
    else:
        with pytest.raises(ValueError, match=want):
            choose_attention(mode, heads, kv, sp)


def test_config_key_values():
    from shardwise.config import ConfigError, load_config

    cfg = load_config({"shardwise": {"sequence_parallel_attention": "ring"}}, world_size=2)
    assert cfg.shardwise.sequence_parallel_attention == "ring"
    assert load_config({}, world_size=2).shardwise.sequence_parallel_attention == "auto"
    with pytest.raises(ConfigError, match="sequence_parallel_attention"):
        load_config({"shardwise": {"sequence_parallel_attention": "flash"}}, world_size=2)


def test_split_batch_zigzag_layout():
    """Ring attention's layout: 7 tokens padded to 8 = 2N chunks of 2; rank r holds chunks r and 3 - r."""
    import torch

    from shardwise.sequence_parallel import split_batch

    class Half:  # an SP group of 2 seen from one rank, without processes
        size, layout = 2, "zigzag"

        def __init__(self, rank):
            self.rank = rank

    ids = torch.arange(10, 17).reshape(1, 7)
    shards = [split_batch({"input_ids": ids, "labels": ids}, Half(r)) for r in (0, 1)]
    assert shards[0]["input_ids"].tolist() == [[10, 11, 16, 0]]
    assert shards[0]["position_ids"].tolist() == [[0, 1, 6, 7]]
    assert shards[0]["shift_labels"].tolist() == [[11, 12, -100, -100]]
    assert shards[1]["input_ids"].tolist() == [[12, 13, 14, 15]]
    assert shards[1]["shift_labels"].tolist() == [[13, 14, 15, 16]]


def test_ring_with_tensor_parallelism_refused_ulysses_kept():
    """Ring attention is not proven with TP: refused in one line, whether asked for or picked by
    "auto"; Ulysses under TP applies its rules to the TP-local heads (4 / 2 = 2 over SP 2)."""
    from shardwise.sequence_parallel import choose_attention

    assert choose_attention("auto", 4, 2, 2, tp_size=2) == "ulysses"
    for mode, heads in (("ring", 4), ("auto", 6)):  # 6 / 2 = 3 local heads: Ulysses cannot split over 2
        with pytest.raises(ValueError, match="ring attention with tensor parallelism") as e:
            choose_attention(mode, heads, 2, 2, tp_size=2)
        assert "\n" not in str(e.value)


def test_token_mask_follows_the_zigzag_layout():
    """The MoE aux loss under SP masks the gathered router logits with ``token_mask``: with ring
    attention's zigzag shards the mask must be laid out as the shards are concatenated, not in
    sequence order (11 tokens, SP 2: 4 chunks of 3, rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2)."""
    from types import SimpleNamespace

    from shardwise.sequence_parallel import token_mask

    ids = torch.zeros(2, 11, dtype=torch.long)
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, 7:] = 0
    got = token_mask({"input_ids": ids, "attention_mask": mask}, SimpleNamespace(size=2, layout="zigzag"))
    assert got.tolist() == [[1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 0, 0]]
    plain = token_mask({"input_ids": ids, "attention_mask": mask}, SimpleNamespace(size=2, layout="contiguous"))
    assert plain.tolist() == [[1] * 11 + [0], [1] * 7 + [0] * 5]
