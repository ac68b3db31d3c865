"""Property test (issue 22): CLI argument vectors over folder trees with symlinks, FIFOs and files.

Each example builds a fresh scratch tree (a checkpoint, a model folder, candidate output paths: a
new name, an existing file, a folder of someone else's files, a symlink to an input, a path inside
an input, a symlink to a folder outside, a FIFO), damages 0-2 input files (a symlink out of the
folder, a FIFO, a folder, a symlink to another file inside, deleted), then runs one
``shardwise consolidate | quantize | generate | estimate`` argument vector in this process.

Allowed outcomes only: exit 0, or exit 2 with one ``shardwise CMD: error: ...`` line (progress
bars above it aside), never a traceback or a hang (an alarm fails a blocked example); the folder
outside the scratch tree is unchanged, none of its secret bytes appear in any file written in the
scratch tree, and the input files are unchanged (an output named with ``--overwrite`` excepted:
writing into the folder, or the symlink, the user named is then what was asked). ``shardwise
train`` starts ranks once its arguments pass, so it is covered by tests/test_hardening.py instead.
Bounded (tests/fuzz_budget.py: ``SHARDWISE_FUZZ_EXAMPLES`` scales it, ``SHARDWISE_FUZZ=long`` runs
thousands with fresh examples) and derandomized in the suite, so the suite is deterministic; each
example within a peak-memory bound.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest
import torch.distributed as dist
from ckpt_cases import _train, small_engine, world1_group
from fuzz_budget import fuzz_settings, memory_bound
from hypothesis import assume, given
from hypothesis import strategies as st
from inference_cases import save_tiny

from shardwise.cli import main as cli

SECRET = b"OUTSIDE-SECRET-7f3a9c"
TAG = "global_step1"
TARGETS = [f"ckpt/{TAG}/metadata.json", f"ckpt/{TAG}/config.json", f"ckpt/{TAG}/rank00000.safetensors",
           "ckpt/latest", "model/config.json", "model/model.safetensors", "model/tokenizer.json",
           "model/tokenizer_config.json"]
DAMAGE = ["symlink_out", "fifo", "folder", "symlink_in", "delete"]
PATHS = ["ckpt", "model", "new_out", "a_file", "foreign", "link_to_input", "ckpt/inside", "link_outside",
         "fifo", "missing", f"ckpt/{TAG}/config.json"]
VALUES = ["0", "1", "2", "-1", "nan", "inf", "1e400", "", "\n", "x", "../x", "/etc/passwd", "5GB", "10KB",
          "fp32", "bf16", "int8", "int4", "disk", "cpu", TAG, TAG + "\n", "0.5", "w1 w2", "w3"]


def settings_for(n: int):
    return fuzz_settings(n, shrink=False, function_fixtures=True)  # no shrinking: bounded time


def _digest(folder: Path) -> dict[str, str]:
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_symlink() or not p.is_file():
            out[str(p.relative_to(folder))] = "link" if p.is_symlink() else "other"
        else:
            out[str(p.relative_to(folder))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    created = world1_group()
    root = tmp_path_factory.mktemp("harden_fuzz")
    engine = small_engine(seed=0)
    _train(engine, 0, 1)
    engine.save_checkpoint(root / "template" / "ckpt")
    save_tiny("llama", str(root / "template" / "model"))
    outside = root / "outside"
    outside.mkdir()
    (outside / "secret.json").write_bytes(b'{"model_type": "llama", "s": "' + SECRET + b'"}')
    (outside / "secret.safetensors").write_bytes(SECRET * 64)
    yield {"root": root, "outside": outside}
    if created and dist.is_initialized():
        dist.destroy_process_group()


def _scratch(world: dict, damage: list[tuple[str, str]]) -> Path:
    s = Path(tempfile.mkdtemp(dir=world["root"], prefix="ex"))
    for name in ("ckpt", "model"):
        shutil.copytree(world["root"] / "template" / name, s / name, symlinks=True)
    (s / "a_file").write_text("someone's file")
    (s / "foreign").mkdir()
    (s / "foreign" / "model.safetensors").write_bytes(b"someone's weights")
    (s / "link_to_input").symlink_to(s / "model")
    (s / "link_outside").symlink_to(world["outside"])
    os.mkfifo(s / "fifo")
    for target, kind in damage:
        p = s / target
        if p.is_file() or p.is_symlink():
            p.unlink()
        if kind == "symlink_out":
            p.symlink_to(world["outside"] / ("secret.safetensors" if p.suffix == ".safetensors" else "secret.json"))
        elif kind == "fifo":
            os.mkfifo(p)
        elif kind == "folder":
            p.mkdir(exist_ok=True)
        elif kind == "symlink_in":
            p.symlink_to(p.parent / ("config.json" if p.name != "config.json" else "tokenizer_config.json"))
    return s


paths = st.sampled_from(PATHS)
damages = st.lists(st.tuples(st.sampled_from(TARGETS), st.sampled_from(DAMAGE)), max_size=2, unique_by=lambda t: t[0])


def mostly(good: str, *others: str) -> st.SearchStrategy:
    """``good`` half the time (so examples get past the first check), else one of ``others`` or a path."""
    return st.one_of(st.just(good), st.sampled_from([*others, *PATHS]))


def _flags(options: dict[str, st.SearchStrategy | None]) -> st.SearchStrategy:
    """A few of ``options`` (flag -> value strategy, None for a switch), as a flat argv list."""
    def render(chosen: list[tuple[str, str | None]]) -> list[str]:
        return [w for flag, v in chosen for w in ([flag] if v is None else [flag, v])]
    pairs = [st.tuples(st.just(f), s if s is not None else st.none()) for f, s in options.items()]
    return st.lists(st.one_of(pairs), max_size=3).map(render)


def values(*choices: str) -> st.SearchStrategy:
    return st.sampled_from([*choices, *VALUES])


OUTS = mostly("new_out", "a_file", "foreign", "link_to_input", "ckpt/inside", "link_outside", "fifo", "model")
COMMANDS = {
    "consolidate": st.tuples(mostly("ckpt"), OUTS, _flags({
        "--tag": values(TAG, "latest", ".global_step1.old"), "--dtype": values("fp16", "float64", "bool"),
        "--max-shard-size": values("1KB", "100KB"), "--no-verify": None, "--config": paths,
        "--weights-only": None, "--overwrite": None}))
    .map(lambda t: ["consolidate", t[0], t[1], *t[2]]),
    "quantize": st.tuples(mostly("model"), OUTS, st.sampled_from(["4", "8", "8", "4", "3"]),
                          _flags({"--group-size": values("16", "64", "100000"), "--overwrite": None}))
    .map(lambda t: ["quantize", t[0], t[1], "--bits", t[2], *t[3]]),
    "generate": st.tuples(mostly("model"), values("w1 w2", "w3 " * 80, " "), _flags({
        "--max-new-tokens": values("1", "3", "63", "99999"), "--offload": values("disk", "cpu"),
        "--prefetch": values("0", "2"), "--threads": values("3"), "--quantize": values("int8", "int4"),
        "--dtype": values("bf16", "fp16"),
        "--greedy": None, "--temperature": values("0", "0.7", "-0.0"), "--top-p": values("0.9", "1"),
        "--seed": values("7")}))
    .map(lambda t: ["generate", "--model", t[0], "--prompt", t[1], *t[2]]),
    "estimate": st.tuples(mostly("model"), values("2", "8")).map(lambda t: ["estimate", "--model", t[0],
                                                                           "--devices", t[1]]),
}


def _run_in(scratch: Path, argv: list[str], capsys) -> tuple[int, str]:
    argv = [str(scratch / a) if a in PATHS else a for a in argv]
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail(f"blocked: {argv}"))
    signal.alarm(60)
    try:
        rc = cli(argv)
    except SystemExit as e:
        rc = e.code
    finally:
        signal.alarm(0)
    return rc, capsys.readouterr().err


def _protected(argv: list[str]) -> list[str]:
    """The input folders the command must not change: all, but an output named with --overwrite
    (consolidate or quantize into the model folder, or a link to it, is then the user's choice)."""
    out = argv[2] if argv[0] in ("consolidate", "quantize") and "--overwrite" in argv else None
    out = "model" if out == "link_to_input" else out
    return [n for n in ("ckpt", "model") if n != out]


def _check(world: dict, scratch: Path, argv: list[str], capsys) -> None:
    keep = _protected(argv)
    outside, inputs = _digest(world["outside"]), {n: _digest(scratch / n) for n in keep}
    rc, err = _run_in(scratch, argv, capsys)
    lines = [ln for ln in err.strip().splitlines() if "it/s]" not in ln]  # progress bars
    if os.environ.get("SHARDWISE_FUZZ_VERBOSE"):
        print(f"\nFUZZ rc={rc} {argv} -> {lines[-1:] or ''}", file=sys.__stdout__)
    assert "Traceback" not in err, (argv, err)
    assert rc in (0, 2), (argv, rc, err)
    if rc == 2:
        assert len(lines) == 1 and lines[0].startswith(f"shardwise {argv[0]}: error: "), (argv, err)
    assert _digest(world["outside"]) == outside, argv
    assert {n: _digest(scratch / n) for n in keep} == inputs, argv
    for p in scratch.rglob("*"):
        if p.is_file() and not p.is_symlink():
            assert SECRET not in p.read_bytes(), (argv, p)
    shutil.rmtree(scratch)


@pytest.mark.parametrize("command,examples", [("consolidate", 100), ("quantize", 30), ("generate", 30),
                                              ("estimate", 20)])
def test_fuzz_cli_over_hostile_trees(world, capsys, command, examples):
    @settings_for(examples)
    @given(argv=COMMANDS[command], damage=damages)
    def run(argv, damage):
        # an output the user named that is a symlink out of the tree, with --overwrite, is written there
        assume(not ("--overwrite" in argv and argv[2] == "link_outside"))
        with memory_bound(what=f"{argv} over {damage}"):
            _check(world, _scratch(world, damage), argv, capsys)

    run()
