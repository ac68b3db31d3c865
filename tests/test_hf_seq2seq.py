"""Seq2SeqTrainer(predict_with_generate=True) and resize_token_embeddings at ZeRO-3, on 2 gloo ranks
through ``shardwise launch --as-deepspeed`` with no DeepSpeed installed (tests/hf_seq2seq_job.py),
against the same code in this one process without DeepSpeed.

Exactness: every parameter is sharded (persistence threshold 0) and gathered to the values the plain
model has (the same seed, or the same saved folder), and each rank runs the same kernels on its
batches as the single process does on the same batches, so predictions, weights and a forward's
loss are compared bit for bit. The eval loss is the mean of per-batch losses gathered from both
ranks, summed in another order than one process sums them: within 1e-6 relative (8 fp32 terms).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import facade_launch  # noqa: E402
import hf_seq2seq_job as job  # noqa: E402


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    """tests/hf_seq2seq_job.py's part of the 2-rank launch this process shares (tests/facade_launch.py),
    which saves :func:`job.tiny_llama` into the part's ``llama/`` before asking for it."""
    out = facade_launch.part(tmp_path_factory, "seq2seq")["root"]
    return {"root": out, **torch.load(out / "results.pt")}


@pytest.mark.subprocess
def test_seq2seq_predict_with_generate_equals_single_process(launched, tmp_path):
    """generate() calls the T5 encoder on its own; it used to compute with NaN placeholders for
    the shared embedding and the final norm, and every prediction was pad tokens."""
    ref = job.predict(tmp_path / "ref", None)
    got = launched["predict"]
    assert len(got["predictions"]) == job.SAMPLES
    assert got["predictions"] == ref["predictions"]
    assert all(len(set(row[1:1 + job.GEN_LEN]) - set(job.SUPPRESS)) >= 1 for row in got["predictions"])
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6)


@pytest.mark.subprocess
def test_resize_token_embeddings_at_stage3_equals_plain(launched):
    """transformers gathers [old.weight, old.bias, new.weight, new.bias] (biases None) to resize at
    ZeRO-3; the resized, sharded model has the plain resized model's every weight and its loss."""
    from transformers import AutoModelForCausalLM

    plain = job.resize(AutoModelForCausalLM.from_pretrained(launched["root"] / "llama"))
    got = launched["resize"]
    assert got["config_vocab"] == job.NEW_VOCAB
    weights = dict(plain.named_parameters())
    assert set(got["weights"]) == set(weights)
    assert [n for n, p in weights.items() if not torch.equal(p.detach(), got["weights"][n])] == []
    ids = job.new_token_batch()
    with torch.no_grad():
        assert got["loss"] == float(plain(input_ids=ids, labels=ids).loss)
