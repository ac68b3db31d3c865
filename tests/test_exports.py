"""Every model folder shardwise writes runs under `shardwise generate`: train's hf/, consolidate's output
(given the run folder itself) and quantize's copy carry the tokenizer and generation config the run
trained with. One world-1 run of a few steps (in a rank pool), then the commands in process; the
2-rank fine-tune of the export runs in the 2-rank pool (its subject is what each rank prints).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from rank_pool import RankPool
from train_cases import train_in

from shardwise.cli import generate as generate_cli
from shardwise.cli.consolidate import main as consolidate_main
from shardwise.cli.quantize import main as quantize_main
from shardwise.train.export import byte_hf_tokenizer
from shardwise.train.model import ByteTokenizer

ROOT = Path(__file__).resolve().parent.parent
DS = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
      "zero_optimization": {"stage": 2}}


@pytest.fixture(scope="module")
def run(tmp_path_factory, pool1: RankPool) -> Path:
    """A one-rank `shardwise train` run with an export (in the pool: tests/train_cases.py)."""
    tmp = tmp_path_factory.mktemp("exports")
    (tmp / "ds.json").write_text(json.dumps(DS))
    out = tmp / "run"
    train_in(pool1, ["--config", str(tmp / "ds.json"), "--model", "llama-micro", "--seq", "64", "--steps", "4",
                     "--save-every", "2", "--eval-every", "0", "--sample-tokens", "0", "--out", str(out)])
    return out


def _generate(folder: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> str:
    capsys.readouterr()
    rc = generate_cli.main(["--model", str(folder), "--prompt", "Shall I compare thee", "--max-new-tokens", "6",
                            *extra])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.startswith("Shall I compare thee") and "6 tokens in" in out, out
    return out


def test_byte_tokenizer_ids_are_the_bytes(tmp_path: Path) -> None:
    """The HF tokenizer of a byte-level run encodes any text to the ids the model trained on."""
    from transformers import AutoTokenizer

    byte_hf_tokenizer().save_pretrained(str(tmp_path))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    text = (ROOT / "data" / "sonnets.txt").read_text()[:3000] + " é 😀\n\t\x00 end"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == ByteTokenizer().encode(text)
    assert tok.decode(ids) == text and len(tok) == 256


def test_train_export_runs_under_generate(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    names = set(os.listdir(run / "hf"))
    assert {"tokenizer.json", "generation_config.json", "config.json", "model.safetensors"} <= names
    _generate(run / "hf", capsys)


def test_consolidate_of_the_run_folder_carries_the_tokenizer(run: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "consolidated"
    assert consolidate_main([str(run), str(out)]) == 0  # the run folder: its checkpoints/ are found
    assert "with the tokenizer" in capsys.readouterr().out
    assert {"tokenizer.json", "generation_config.json"} <= set(os.listdir(out))
    assert consolidate_main([str(run), str(out)]) == 0  # again into our own output: allowed
    _generate(out, capsys)
    quantized = tmp_path / "int8"
    assert quantize_main([str(out), str(quantized), "--bits", "8"]) == 0
    assert "tokenizer.json" in os.listdir(quantized)
    _generate(quantized, capsys, "--offload", "disk")


def test_consolidate_names_the_folder_to_pass(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fresh = tmp_path / "fresh_run"
    fresh.mkdir()
    (fresh / "run_config.json").write_text("{}")
    assert consolidate_main([str(fresh), str(tmp_path / "o1")]) == 2
    assert "saved no checkpoint yet" in capsys.readouterr().err
    (run / "checkpoints" / "latest").rename(run / "checkpoints" / "latest.bak")
    try:
        assert consolidate_main([str(run / "checkpoints"), str(tmp_path / "o2")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "pass --tag (one of global_step2, global_step4)" in err, err
    finally:
        (run / "checkpoints" / "latest.bak").rename(run / "checkpoints" / "latest")


def test_only_rank_0_shows_the_loading_bar(run: Path, tmp_path: Path, pool2: RankPool) -> None:
    """Fine-tuning the export on 2 ranks: transformers' "Loading weights" bar once, not once per rank.

    Each rank's own output is checked (in the pool, as `shardwise train` runs on each rank of a
    launch): rank 0 shows the bar once, rank 1 not at all, so a launch's merged output has it once."""
    (tmp_path / "ds.json").write_text(json.dumps(DS))
    argv = ["--config", str(tmp_path / "ds.json"), "--model", str(run / "hf"), "--seq", "64", "--steps", "1",
            "--eval-every", "0", "--sample-tokens", "0", "--no-export", "--out", str(tmp_path / "ft")]
    answers = pool2.run("train_cases:train", argv)
    logs = [stdout + stderr for _, stdout, stderr in answers]
    assert [code for code, _, _ in answers] == [0, 0], logs
    assert [log.count("Loading weights: 100%") for log in logs] == [1, 0], logs
    assert "communication per rank: " in logs[0] and "iB" in logs[0].split("communication per rank: ")[1].split("\n")[0]


def test_generate_names_a_missing_tokenizer(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((run / "hf" / name).read_bytes())
    with pytest.raises(SystemExit) as info:
        generate_cli.main(["--model", str(bare), "--prompt", "Shall I"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no tokenizer files there" in err, err
