"""`shardwise train` end to end on 2 gloo ranks (and 1), tiny models: the runs go through the CLI's
own entry (``shardwise.cli.train.main``) inside the rank pools (tests/train_cases.py); the SIGTERM
stop and the one-line data error run the real command in subprocesses, the process being their subject.

What is proven: a run stopped by SIGTERM at a random step and resumed with --resume auto gives the
same per-step losses as an uninterrupted run (bit for bit at the same world, within the fp32
equivalence tolerance at world 1, and at another TP degree and stage); the exported hf/ folder
loads in plain transformers and scores the run's last eval loss; an HF folder trains under
zero.Init at stage 3 starting from its weights; each data format tokenizes to the expected
stream; a bad JSONL line is named; the loss goes down.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from rank_pool import RankPool

from shardwise.cli.train_options import parse_args
from shardwise.train.data import DataError, TokenData, list_sources, read_documents, tokenize_to_cache
from shardwise.train.model import ByteTokenizer
from shardwise.train.outputs import read_metrics

ROOT = Path(__file__).resolve().parent.parent
SONNETS = ROOT / "data" / "sonnets.txt"
# micro 2 x dp 2 x gas 2 at world 2; gas 4 at world 1: the same 8 sequences per step at both
DS = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
      "steps_per_print": 0, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
      "zero_optimization": {"stage": 2}}
STEPS = 40
RTOL = 1e-5  # fp32 at another world size: only the reduction order differs (the project's tolerance)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _cmd(nproc: int | None, *args: str) -> list[str]:
    base = [sys.executable, "-m", "shardwise.cli"]
    if nproc is None:  # one plain process (world 1, no torchrun)
        return [*base, "train", *args]
    return [*base, "launch", "--nproc", str(nproc), "--", "train", *args]


def _args(tmp: Path, out: Path, *extra: str, ds: dict | None = None, export: bool = False) -> list[str]:
    cfg = tmp / f"ds_{out.name}.json"
    cfg.write_text(json.dumps(ds or DS))
    return ["--config", str(cfg), "--model", "llama-micro", "--seq", "64", "--steps", str(STEPS),
            "--eval-every", "10", "--save-every", "0", "--sample-tokens", "0", "--out", str(out),
            *([] if export else ["--no-export"]), *extra]


def _train(tmp: Path, out: Path, nproc: int | None = 2, *extra: str, ds: dict | None = None,
           check: bool = True, export: bool = False) -> subprocess.CompletedProcess:
    """The real command in a process of its own (for the tests whose subject is the process)."""
    args = _args(tmp, out, *extra, ds=ds, export=export)
    r = subprocess.run(_cmd(nproc, *args), env=_env(), capture_output=True, text=True, timeout=300)
    if check:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _train_in(pool: RankPool, tmp: Path, out: Path, *extra: str, ds: dict | None = None,
              export: bool = False) -> str:
    """The same run on the pool's ranks (the pool's world size); returns rank 0's output."""
    answers = pool.run("train_cases:train", _args(tmp, out, *extra, ds=ds, export=export), timeout=300)
    for rank, (code, stdout, stderr) in enumerate(answers):
        assert code == 0, f"rank {rank}: exit {code}\n{stdout[-3000:]}{stderr[-3000:]}"
    return answers[0][1]


def _losses(out: Path) -> dict[tuple[str, int], float]:
    return {(m["kind"], m["step"]): m["loss" if m["kind"] == "train" else "eval_loss"] for m in read_metrics(out)}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, pool2: RankPool) -> Path:
    """An uninterrupted 2-rank run with checkpoints every 10 steps (keep 2), sample and hf/ export."""
    tmp = tmp_path_factory.mktemp("train")
    out = tmp / "full"
    _train_in(pool2, tmp, out, "--save-every", "10", "--keep", "2", "--sample-tokens", "16", export=True)
    return out


def _sigterm_at_random_step(tmp: Path, out: Path) -> int:
    """Start a run, SIGTERM the launcher once metrics reach a random step; returns the saved step."""
    cfg = tmp / "ds_killed.json"
    cfg.write_text(json.dumps(DS))
    k = random.randint(3, 25)
    args = ["--config", str(cfg), "--model", "llama-micro", "--seq", "64", "--steps", str(STEPS), "--eval-every",
            "10", "--save-every", "0", "--sample-tokens", "0", "--no-export", "--out", str(out)]
    proc = subprocess.Popen(_cmd(2, *args), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        rows = [m for m in read_metrics(out) if m["kind"] == "train"] if (out / "metrics.jsonl").exists() else []
        if len(rows) >= k:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    log, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, log[-3000:]
    assert "stopped by signal" in log, f"the run ended before the signal (k={k}):\n{log[-2000:]}"
    saved = int((out / "checkpoints" / "latest").read_text().removeprefix("global_step"))
    assert k <= saved < STEPS
    assert max(m["step"] for m in read_metrics(out)) == saved
    return saved


@pytest.mark.subprocess
def test_sigterm_then_resume_equals_uninterrupted(full_run: Path, tmp_path: Path, pool2: RankPool,
                                                  pool1: RankPool) -> None:
    """The launched run is stopped by SIGTERM (the process is the subject); the resumes run in the pools."""
    killed = tmp_path / "killed"
    saved = _sigterm_at_random_step(tmp_path, killed)
    other_world = tmp_path / "world1"
    shutil.copytree(killed, other_world)
    _train_in(pool2, tmp_path, killed, "--resume", "auto")
    _train_in(pool1, tmp_path, other_world, "--resume", "auto")
    want, same, w1 = _losses(full_run), _losses(killed), _losses(other_world)
    assert set(want) == set(same) == set(w1)
    assert same == want, f"resumed at step {saved} at the same world: losses differ"
    for key, v in want.items():
        assert math.isclose(w1[key], v, rel_tol=RTOL), (key, w1[key], v, saved)


def test_resume_at_another_tp_degree_and_stage(full_run: Path, tmp_path: Path, pool2: RankPool) -> None:
    """Half the run at TP 2 x ZeRO-1 (dp 1, accumulation 4), the rest at dp 2 x ZeRO-2: same losses."""
    out = tmp_path / "tp_then_dp"
    tp = {**DS, "zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": 2}}
    _train_in(pool2, tmp_path, out, "--steps", str(STEPS // 2), ds=tp)
    _train_in(pool2, tmp_path, out, "--resume", "auto")
    want, got = _losses(full_run), _losses(out)
    assert set(got) == set(want)
    for key, v in want.items():
        assert math.isclose(got[key], v, rel_tol=RTOL), (key, got[key], v)


def test_sequence_parallel_flag_then_resume_without_sp(full_run: Path, tmp_path: Path, pool2: RankPool) -> None:
    """Half the run with --sp 2 (one replica, accumulation 4, every sequence split over both ranks),
    the rest at dp 2 without SP: the per-step train and eval losses of the plain run."""
    out = tmp_path / "sp_then_dp"
    _train_in(pool2, tmp_path, out, "--steps", str(STEPS // 2), "--sp", "2")
    _train_in(pool2, tmp_path, out, "--resume", "auto")
    want, got = _losses(full_run), _losses(out)
    assert set(got) == set(want)
    for key, v in want.items():
        assert math.isclose(got[key], v, rel_tol=RTOL), (key, got[key], v)


def test_outputs_of_a_run(full_run: Path) -> None:
    train = [m for m in read_metrics(full_run) if m["kind"] == "train"]
    evals = [m for m in read_metrics(full_run) if m["kind"] == "eval"]
    assert [m["step"] for m in train] == list(range(1, STEPS + 1))
    assert [m["step"] for m in evals] == [10, 20, 30, 40]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] < math.log(256)  # the loss goes down
    assert np.mean([m["loss"] for m in train[-5:]]) < np.mean([m["loss"] for m in train[:5]])
    row = train[-1]
    assert row["memory"]["total"] > 0 and row["comm_bytes"]["reduce_scatter"] > 0 and row["grad_norm"] > 0
    assert row["tokens"] == STEPS * 8 * 64
    assert sorted(p.name for p in (full_run / "checkpoints").iterdir()) == ["global_step30", "global_step40",
                                                                            "latest", "zero_to_fp32.py"]  # --keep 2
    assert (full_run / "loss.png").stat().st_size > 0 and (full_run / "sample.txt").read_text().strip()
    assert json.loads((full_run / "run_config.json").read_text())["config"]["zero_optimization"]["stage"] == 2


def test_hf_export_loads_in_transformers_and_scores_the_last_eval(full_run: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(full_run / "hf")).eval()
    meta = next((full_run / "data").glob("tokens-*.json"))
    data = TokenData.open(meta, 64, 0.1, 1234)
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(data.n_train, data.n_train + data.n_eval):
            ids = torch.from_numpy(data.sequence(i))[None]
            total += float(model(input_ids=ids, labels=ids).loss) * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    last = [m for m in read_metrics(full_run) if m["kind"] == "eval"][-1]["eval_loss"]
    assert math.isclose(total / count, last, rel_tol=RTOL)


def test_hf_folder_trains_under_zero_init_from_its_weights(full_run: Path, tmp_path: Path, pool2: RankPool) -> None:
    """--model HF_DIR at stage 3: the first step's loss is the exported model's loss on that batch."""
    from transformers import AutoModelForCausalLM

    ds = {**DS, "zero_optimization": {"stage": 3}}
    out = tmp_path / "finetune"
    _train_in(pool2, tmp_path, out, "--model", str(full_run / "hf"), "--steps", "2", ds=ds)
    data = TokenData.open(next((out / "data").glob("tokens-*.json")), 64, 0.1, 1234)
    batch = torch.from_numpy(np.stack([data.sequence(i) for i in data.train_ids(0, 8)]))
    model = AutoModelForCausalLM.from_pretrained(str(full_run / "hf")).eval()
    with torch.no_grad():  # micro-batches of 2 averaged = the mean over the 8 rows (equal lengths)
        want = float(np.mean([float(model(input_ids=b, labels=b).loss) for b in batch.split(2)]))
    got = _losses(out)[("train", 1)]
    assert math.isclose(got, want, rel_tol=RTOL), (got, want)


# -- data formats (in process: the stream is checked token by token) --------------------------------
def _stream(sources: list[Path], tmp: Path) -> list[int]:
    meta = tokenize_to_cache(sources, ByteTokenizer(), tmp / "cache")
    m = json.loads(meta.read_text())
    return np.fromfile(meta.parent / m["file"], dtype=m["dtype"]).tolist()


def test_text_file(tmp_path: Path) -> None:
    assert _stream(list_sources(SONNETS), tmp_path) == list(SONNETS.read_bytes())


def test_folder_of_text_files(tmp_path: Path) -> None:
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    (d / "b.txt").write_text("second\n")
    (d / "a.txt").write_text("first")  # no trailing newline: one is added between documents
    (d / "sub" / "c.md").write_text("third\n")
    (d / ".hidden").write_text("skipped\n")
    assert _stream(list_sources(d), tmp_path) == list(b"first\nsecond\nthird\n")


def test_jsonl(tmp_path: Path) -> None:
    f = tmp_path / "docs.jsonl"
    f.write_text(json.dumps({"text": "one", "id": 1}) + "\n\n" + json.dumps({"text": "two\n"}) + "\n")
    assert _stream([f], tmp_path) == list(b"one\ntwo\n")


def test_jsonl_bad_line_is_named(tmp_path: Path) -> None:
    f = tmp_path / "docs.jsonl"
    f.write_text('{"text": "ok"}\n{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(DataError, match=r"docs\.jsonl:3: not a JSON object"):
        list(read_documents(f))
    f.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match=r"docs\.jsonl:2: no string field \"text\" \(found \['body'\]\)"):
        list(read_documents(f))


@pytest.mark.subprocess
def test_jsonl_bad_line_cli_error(tmp_path: Path) -> None:
    f = tmp_path / "docs.jsonl"
    f.write_text('{"text": "ok"}\n{"text": "ok"}\n{"text": oops}\n')
    r = _train(tmp_path, tmp_path / "bad", None, "--data", str(f), check=False)
    assert r.returncode == 2
    assert f"shardwise train: error: {f}:3: not a JSON object" in r.stderr
    assert "Traceback" not in r.stderr


def test_config_json_model_with_folder_tokenizer_on_jsonl(tmp_path: Path, pool1: RankPool) -> None:
    """--model DIR holding only config.json and a tokenizer: from scratch, tokenized by that tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([SONNETS.read_text()], trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>")
    folder = tmp_path / "model"
    hf_tok.save_pretrained(str(folder))
    LlamaConfig(vocab_size=len(hf_tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64).save_pretrained(str(folder))
    docs = [line for line in SONNETS.read_text().split("\n\n") if line.strip()]
    data = tmp_path / "sonnets.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = tmp_path / "run"
    _train_in(pool1, tmp_path, out, "--model", str(folder), "--data", str(data), "--seq", "16", "--steps", "3",
              "--eval-every", "0", "--eval-fraction", "0.2")
    meta = json.loads(next((out / "data").glob("tokens-*.json")).read_text())
    stream = np.fromfile(out / "data" / meta["file"], dtype=meta["dtype"]).tolist()
    want = [t for d in docs for t in hf_tok(d, add_special_tokens=False)["input_ids"] + [hf_tok.eos_token_id]]
    assert stream == want and meta["documents"] == len(docs)
    assert len([m for m in read_metrics(out) if m["kind"] == "train"]) == 3


def test_run_config_file_and_flag_override(tmp_path: Path) -> None:
    rc = tmp_path / "run.toml"
    rc.write_text('steps = 7\nsave-every = 3\nmodel = "llama-micro"\n[config]\ntrain_batch_size = 4\n'
                  '[config.scheduler]\ntype = "WarmupDecayLR"\n[config.scheduler.params]\n'
                  'total_num_steps = "auto"\n')
    args = parse_args(["--run-config", str(rc), "--steps", "9"])
    assert (args.steps, args.save_every, args.model) == (9, 3, "llama-micro")
    assert args.ds_config["scheduler"]["params"]["total_num_steps"] == 9  # "auto" = --steps
    rc.write_text("stepz = 7\n")
    with pytest.raises(SystemExit):
        parse_args(["--run-config", str(rc), "--config", "x.json"])
    with pytest.raises(SystemExit):
        parse_args(["--config", "x.json", "--eval-fraction", "1.5"])


def test_timeout_from_the_config_key_unless_the_flag_is_given(tmp_path: Path) -> None:
    """`shardwise.timeout_s` in the DeepSpeed config sets the collective timeout of `train`, as it does
    for initialize(); --timeout overrides it; a bad value is a one-line usage error."""
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 4, "shardwise": {"timeout_s": 42}}))
    assert parse_args(["--config", str(cfg)]).timeout == 42
    assert parse_args(["--config", str(cfg), "--timeout", "7"]).timeout == 7
    cfg.write_text(json.dumps({"train_batch_size": 4, "shardwise": {"timeout_s": "42"}}))
    with pytest.raises(SystemExit):
        parse_args(["--config", str(cfg)])


def test_sp_flag_sets_the_config_key_and_refuses_a_conflict(tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 4}))
    assert parse_args(["--config", str(cfg), "--sp", "2"]).ds_config["sequence_parallel_size"] == 2
    cfg.write_text(json.dumps({"train_batch_size": 4, "sequence_parallel_size": 4}))
    with pytest.raises(SystemExit) as e:
        parse_args(["--config", str(cfg), "--sp", "2"])
    assert e.value.code == 2 and "disagrees with the config's sequence_parallel_size 4" in capsys.readouterr().err
