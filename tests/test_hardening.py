"""Hardening, round two (issue 22): one test per item of "What was seen".

Symlinks and special files, commands that write beside the user's files, values that cannot
survive a choice, one-line errors for what transformers rejects, and streaming tokenization. CLI
cases run in this process (``shardwise.cli.main``); the two that need a finished run or a fresh
process's memory use a subprocess.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
from argparse import Namespace
from pathlib import Path

import fresh_ranks
import numpy as np
import pytest
import torch.distributed as dist
from ckpt_cases import _train, same_state, small_engine, snapshot, world1_group
from inference_cases import save_tiny
from train_cases import train_in

from shardwise.checkpoint import CheckpointError
from shardwise.cli import main as cli
from shardwise.errors import UserError
from shardwise.train import tokenize_stream
from shardwise.train.data import tokenize_to_cache
from shardwise.train.model import ByteTokenizer
from shardwise.train.outputs import MetricsLog, read_metrics

ROOT = Path(__file__).resolve().parent.parent
TAG = "global_step1"


def one_line_error(capsys, argv: list[str], *names: str) -> str:
    """Run the CLI in-process: exit code 2, one line on stderr naming ``names``, no traceback."""
    try:
        rc = cli(argv)
    except SystemExit as e:  # argparse's usage errors
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc == 2, (rc, err)
    last = err.splitlines()[-1] if err else ""  # above it only progress bars (transformers' loading)
    assert "Traceback" not in err and last.startswith("shardwise ") and ": error: " in last, err
    assert all("it/s]" in ln for ln in err.splitlines()[:-1]), err
    err = last
    for n in names:
        assert n in err, (n, err)
    return err


def digest(folder: Path) -> dict[str, str]:
    """Content hash of every regular file under ``folder`` (symlinks not followed)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    created = world1_group()
    root = tmp_path_factory.mktemp("harden")
    engine = small_engine(seed=0)
    _train(engine, 0, 1)
    engine.save_checkpoint(root / "ckpt")
    yield {"ckpt": root / "ckpt", "engine": engine}
    if created and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("model") / "m"
    save_tiny("llama", str(folder))
    return folder


def _copy(src: Path, tmp_path: Path, name: str = "copy") -> Path:
    dst = tmp_path / name
    shutil.copytree(src, dst, symlinks=True)
    return dst


# -- 1. symlinks and special files are followed ----------------------------------------------------
def test_metadata_symlinked_out_of_the_folder_is_refused(saved, tmp_path):
    ckpt = _copy(saved["ckpt"], tmp_path)
    outside = tmp_path / "elsewhere.json"
    shutil.move(ckpt / TAG / "metadata.json", outside)
    (ckpt / TAG / "metadata.json").symlink_to(outside)
    engine = small_engine(seed=9)
    before = snapshot(engine)
    with pytest.raises(CheckpointError, match="metadata.json.*outside"):
        engine.load_checkpoint(ckpt)
    assert same_state(before, snapshot(engine)) == []


def test_consolidate_refuses_config_symlinked_outside(saved, tmp_path, capsys):
    ckpt = _copy(saved["ckpt"], tmp_path)
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"model_type": "llama", "secret": "do-not-copy"}))
    (ckpt / TAG / "config.json").unlink()
    (ckpt / TAG / "config.json").symlink_to(secret)
    one_line_error(capsys, ["consolidate", str(ckpt), str(tmp_path / "out")], "config.json", "outside")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_metadata_fifo_is_refused_without_blocking(saved, tmp_path):
    ckpt = _copy(saved["ckpt"], tmp_path)
    (ckpt / TAG / "metadata.json").unlink()
    os.mkfifo(ckpt / TAG / "metadata.json")
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("load_checkpoint blocked on a FIFO"))
    signal.alarm(20)
    try:
        with pytest.raises(CheckpointError, match="metadata.json.*FIFO"):
            small_engine(seed=9).load_checkpoint(ckpt)
    finally:
        signal.alarm(0)


# -- 2. commands that write where the user's files are ---------------------------------------------
def test_consolidate_keeps_other_files_of_the_output_folder(saved, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.safetensors").write_bytes(b"user weights")
    (out / "notes.txt").write_text("mine")
    one_line_error(capsys, ["consolidate", str(saved["ckpt"]), str(out)], "keep.safetensors", "--overwrite")
    assert sorted(os.listdir(out)) == ["keep.safetensors", "notes.txt"]
    assert cli(["consolidate", str(saved["ckpt"]), str(out), "--overwrite"]) == 0
    assert (out / "keep.safetensors").read_bytes() == b"user weights" and (out / "notes.txt").read_text() == "mine"
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    # a rerun replaces only its own outputs (recorded in .shardwise-outputs.json), without --overwrite
    shutil.rmtree(out)
    assert cli(["consolidate", str(saved["ckpt"]), str(out)]) == 0
    assert cli(["consolidate", str(saved["ckpt"]), str(out), "--max-shard-size", "20KB"]) == 0
    assert not (out / "model.safetensors").exists() and (out / "model.safetensors.index.json").is_file()
    one_line_error(capsys, ["consolidate", str(saved["ckpt"]), str(saved["ckpt"] / "hf")], "inside the input")


def test_quantize_into_a_symlink_to_its_source_is_refused(model_dir, tmp_path, capsys):
    src = _copy(model_dir, tmp_path, "src")
    before = digest(src)
    (tmp_path / "dst").symlink_to(src)
    one_line_error(capsys, ["quantize", str(src), str(tmp_path / "dst"), "--bits", "8"], "DST", "inside the input")
    assert digest(src) == before


def test_train_out_inside_data_and_out_a_file_are_refused(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("hello world\n" * 50)
    base = ["train", "--config", str(ROOT / "examples" / "zero2_llama.json"), "--data", str(corpus)]
    one_line_error(capsys, [*base, "--out", str(corpus / "run")], "--out", "inside the input")
    (tmp_path / "afile").write_text("x")
    one_line_error(capsys, [*base, "--out", str(tmp_path / "afile")], "--out", "existing file")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "thesis.tex").write_text("x")
    one_line_error(capsys, [*base, "--out", str(tmp_path / "busy")], "thesis.tex", "--overwrite")
    assert sorted(os.listdir(corpus)) == ["a.txt"]


# -- 3. choices that lose the values, degenerate sizes ---------------------------------------------
def test_consolidate_integer_dtype_is_refused(saved, tmp_path, capsys):
    one_line_error(capsys, ["consolidate", str(saved["ckpt"]), str(tmp_path / "o"), "--dtype", "int8"], "--dtype")
    assert not (tmp_path / "o").exists()


def test_train_seq_1_is_refused(capsys):
    one_line_error(capsys, ["train", "--config", str(ROOT / "examples" / "zero2_llama.json"), "--seq", "1"],
                   "--seq")


def test_non_finite_client_state_and_unreadable_tags_are_refused_at_save(saved, tmp_path):
    engine = saved["engine"]
    with pytest.raises(ValueError, match=r"client_state\['x'\]\['y'\] is inf"):
        engine.save_checkpoint(tmp_path / "c", client_state={"x": {"y": float("inf")}})
    for tag in ("step\n", " step", "a\\b", "\x00"):
        with pytest.raises(ValueError, match="plain folder name"):
            engine.save_checkpoint(tmp_path / "c", tag=tag)
    assert not (tmp_path / "c").exists() or not any(p.name.strip() != p.name or not p.name.startswith(".")
                                                    for p in (tmp_path / "c").iterdir())


def test_generate_refuses_empty_and_too_long_prompts(model_dir, capsys):
    one_line_error(capsys, ["generate", "--model", str(model_dir), "--prompt", ""], "--prompt")
    long = " ".join(["w5"] * 70)  # the tiny model has 64 positions
    one_line_error(capsys, ["generate", "--model", str(model_dir), "--prompt", long, "--max-new-tokens", "2"],
                   "64 positions")


def test_train_sample_with_a_too_long_prompt_keeps_the_export(tmp_path, pool1):
    """A finished run whose end-of-run sample prompt is longer than the model's positions (or
    empty) still exports, samples, and exits 0."""
    out = tmp_path / "run"
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 0,
                               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}))
    train_in(pool1, ["--config", str(cfg), "--model", "llama-micro", "--seq", "16", "--steps", "1", "--eval-fraction",
                     "0", "--save-every", "0", "--sample-tokens", "4", "--prompt", "x" * 300, "--out", str(out)])
    assert (out / "hf" / "model.safetensors").is_file() and (out / "sample.txt").is_file()


def test_model_folder_missing_a_weight_is_refused(model_dir, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    folder = _copy(model_dir, tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    dropped = "model.layers.1.mlp.down_proj.weight"
    del tensors[dropped]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    one_line_error(capsys, ["generate", "--model", str(folder), "--prompt", "w1 w2"], dropped, "random init")
    one_line_error(capsys, ["generate", "--model", str(folder), "--prompt", "w1 w2", "--offload", "disk"], dropped)


# -- 4. tracebacks instead of one line -------------------------------------------------------------
@pytest.mark.parametrize("damage", ["config not json", "unknown model_type", "negative layers",
                                    "truncated weights", "corrupt tokenizer"])
def test_model_folders_transformers_rejects_are_one_line(model_dir, tmp_path, capsys, damage):
    folder = _copy(model_dir, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    if damage == "config not json":
        (folder / "config.json").write_text("{not json")
    elif damage == "unknown model_type":
        (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "no-such-model"}))
    elif damage == "negative layers":
        (folder / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": -2}))
    elif damage == "truncated weights":
        raw = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(raw[:len(raw) // 2])
    else:
        (folder / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nope"}}')
    for extra in ([], ["--offload", "disk"]):
        one_line_error(capsys, ["generate", "--model", str(folder), "--prompt", "w1", *extra], str(folder))


def test_generate_temperature_0_is_greedy(model_dir, capsys):
    assert cli(["generate", "--model", str(model_dir), "--prompt", "w1 w2", "--max-new-tokens", "4",
                "--temperature", "0"]) == 0
    zero = capsys.readouterr().out.split("\n[shardwise generate]")[0]
    assert cli(["generate", "--model", str(model_dir), "--prompt", "w1 w2", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.split("\n[shardwise generate]")[0] == zero
    one_line_error(capsys, ["generate", "--model", str(model_dir), "--prompt", "w1", "--temperature", "-1"],
                   "--temperature")


def test_resume_auto_of_a_checkpoint_not_from_a_run_is_one_error(tmp_path):
    from shardwise.train.run import Job, _resume

    class Engine:
        def load_checkpoint(self, path):
            return str(path), {"epoch": 3}  # another program's client_state: no step count

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text(TAG)
    job = Job(Namespace(resume="auto", steps=5), Engine(), None, None, tmp_path, 1, {})
    with pytest.raises(UserError, match="not a shardwise train run"):
        _resume(job)


def test_metrics_with_a_partial_last_line_resume(tmp_path):
    rows = [{"kind": "train", "step": s, "loss": 1.0} for s in (1, 2, 3)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "metrics.jsonl").write_text(text + '{"kind": "train", "st')  # killed while writing
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    MetricsLog(tmp_path, resume_step=2).close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    (tmp_path / "metrics.jsonl").write_text("garbage\n" + text)
    with pytest.raises(UserError, match=r"metrics.jsonl:1"):
        read_metrics(tmp_path)


# -- 5. memory -------------------------------------------------------------------------------------
def _bpe_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    text = (ROOT / "data" / "sonnets.txt").read_text()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))

    class Wrapped:
        name, vocab_size, eos_token_id = "bpe", 400, None

        def encode(self, t: str) -> list[int]:
            return tok.encode(t).ids

    return Wrapped()


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_streamed_tokens_equal_whole_document_tokens(tmp_path, monkeypatch, kind):
    tokenizer = ByteTokenizer() if kind == "bytes" else _bpe_tokenizer()
    text = (ROOT / "data" / "sonnets.txt").read_text()
    (tmp_path / "one.txt").write_text(text.replace("\n", " ") + "é" * 3000)  # one long line, multi-byte tail
    want = tokenizer.encode(text.replace("\n", " ") + "é" * 3000)
    monkeypatch.setattr(tokenize_stream, "CHUNK_CHARS", 2000)
    monkeypatch.setattr(tokenize_stream, "CHECK_CHARS", 64)
    monkeypatch.setattr("shardwise.train.data.READ_BYTES", 777)  # pieces cut inside UTF-8 characters
    meta = json.loads(tokenize_to_cache([tmp_path / "one.txt"], tokenizer, tmp_path / "cache").read_text())
    got = np.fromfile(tmp_path / "cache" / meta["file"], dtype=meta["dtype"]).tolist()
    sep = tokenizer.encode("\n")
    assert got == want + sep


@pytest.mark.subprocess
def test_tokenizing_a_50mb_line_is_bounded_by_a_chunk(tmp_path):
    """Peak RSS growth of tokenizing one 48 MB line (byte tokenizer) in a process of its own (forked
    after the imports, tests/fresh_ranks.py); before the change it grew by 16x the file (a Python list
    of ints), now by a few chunks."""
    big = tmp_path / "big.txt"
    with big.open("w") as f:
        for _ in range(48):
            f.write("lorem ipsum dolor sit amet " * 38836)  # 1 MiB of one line
    rank = fresh_ranks.start("process_cases:tokenize_peak_growth", [str(big), str(tmp_path / "cache")],
                             {**os.environ, "OMP_NUM_THREADS": "1"}, tmp_path / "proc")
    assert rank.wait(timeout=300) == 0, rank.communicate()[1][-2000:]
    out = rank.communicate()[0]
    growth_mib = float(out.strip().splitlines()[-1])
    assert growth_mib < 100, f"tokenizing a 48 MiB line grew RSS by {growth_mib:.0f} MiB"
    assert os.path.getsize(next((tmp_path / "cache").glob("*.bin"))) == 2 * (big.stat().st_size + 1)
