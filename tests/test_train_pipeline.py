"""`shardwise train --pp N` (shardwise/train/pipeline_job.py) on the rank pools: the stages train, evaluate,
checkpoint, resume, sample and export as the run without stages does, and the export is plain transformers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from train_cases import train_in

CFG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 0,
       "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, "zero_optimization": {"stage": 1}}
# the step's mean loss: the pipeline sums its micro-batch losses in fp32, the loop in Python floats (measured:
# 5e-8 relative at 4 steps); the weights themselves are bit-exact
LOSS_RTOL = 1e-6


def _argv(tmp_path: Path, out: Path, steps: int, *extra: str) -> list[str]:
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(CFG))
    return ["--config", str(cfg), "--model", "llama-micro", "--seq", "32", "--steps", str(steps), "--eval-every", "0",
            "--save-every", "2", "--sample-tokens", "4", "--out", str(out), *extra]


def _records(out: Path, kind: str, key: str) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in rows if r["kind"] == kind}


def _export_eval_loss(out: Path) -> float:
    """The held-out loss of RUN/hf in plain transformers, token-weighted as the run's eval is."""
    from transformers import AutoModelForCausalLM

    from shardwise.train.data import TokenData

    model = AutoModelForCausalLM.from_pretrained(str(out / "hf")).eval()
    data = TokenData.open(next((out / "data").glob("tokens-*.json")), 32, 0.1, 1234)
    total = count = 0.0
    with torch.no_grad():
        for mb in data.eval_batches(2):
            n = mb.shape[0] * (mb.shape[1] - 1)
            total += float(model(input_ids=mb, labels=mb).loss) * n
            count += n
    return total / count


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF export, one file or shards."""
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("model*.safetensors")) for k, v in load_file(str(f)).items()}


def _tied_config(tmp_path: Path) -> str:
    """A config.json of a tiny Llama whose head is its embedding (tie_word_embeddings)."""
    from transformers import LlamaConfig

    path = tmp_path / "tied.json"
    LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=True).to_json_file(str(path))
    return str(path)


@pytest.mark.parametrize("tied", [False, True])
def test_pp2_gives_pp1s_losses_weights_and_export(pool1, pool2, tmp_path, tied: bool) -> None:
    """--pp 2 on 2 ranks (stopped at step 2, resumed to 3) against --pp 1 on 1 rank, the same global batch:
    the same losses, the same exported weights (bit for bit untied; tied, the embedding's gradient is summed
    over its two stages in another order: 1e-5), and the export's held-out loss in transformers is the
    stages' final eval loss. Tied, the export is tied too and the checkpoint holds the owner's copy."""
    one, two = tmp_path / "pp1", tmp_path / "pp2"
    model = ["--model", _tied_config(tmp_path)] if tied else []
    train_in(pool1, _argv(tmp_path, one, 3, *model))
    train_in(pool2, _argv(tmp_path, two, 2, "--pp", "2", *model))
    log = train_in(pool2, _argv(tmp_path, two, 3, "--pp", "2", "--resume", "auto", *model))
    assert "resumed from" in log and "(pp 2 x tp 1 x sp 1 x dp 1)" in log
    made = re.search(r"pipeline stage 0: ([\d,]+) of the model's ([\d,]+) parameter bytes made real", log)
    assert made and 0 < int(made[1].replace(",", "")) < int(made[2].replace(",", "")), log
    a, b = _records(one, "train", "loss"), _records(two, "train", "loss")
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=LOSS_RTOL, abs=0)
    ea, eb = _records(one, "eval", "eval_loss"), _records(two, "eval", "eval_loss")
    assert eb[3] == pytest.approx(ea[3], rel=LOSS_RTOL, abs=0)
    wa, wb = _weights(one / "hf"), _weights(two / "hf")
    assert len(list((two / "hf").glob("model-*-of-00002.safetensors"))) == 2  # one shard a stage, none gathered
    assert sorted(wa) == sorted(wb) and ("lm_head.weight" in wa) != tied
    for name, t in wa.items():
        if tied:
            torch.testing.assert_close(wb[name], t, rtol=1e-5, atol=1e-7)
        else:
            assert torch.equal(t, wb[name]), name
    assert _export_eval_loss(two) == pytest.approx(eb[3], rel=1e-6, abs=0)
    assert (two / "sample.txt").read_text() == (one / "sample.txt").read_text()


@pytest.mark.parametrize(("extra", "words"), [
    (["--pp", "3"], "not divisible into 3 pipeline stages"),
    (["--pp", "2", "--sp", "2"], "--pp 2 with --sp / sequence_parallel_size is not served"),
])
def test_pp_refusals_are_one_line(pool2, tmp_path, extra: list[str], words: str) -> None:
    """A world --pp does not divide, and --pp with --sp: exit 2 and one line, before any work."""
    answers = pool2.run("train_cases:train", _argv(tmp_path, tmp_path / "run", 1, *extra))
    assert [code for code, _, _ in answers] == [2, 2]
    err = answers[0][2].strip()
    assert words in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists()
