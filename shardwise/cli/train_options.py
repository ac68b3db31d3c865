"""Options of `shardwise train`: flags, the run config file, validation, and the resolved config.

Every option is a flag and also a key of a run config file (``--run-config run.toml`` or ``.json``;
keys are the flag names with ``_`` or ``-``); flags given on the command line override the file.
The DeepSpeed config (``--config``, or a ``config`` table/object inside the run config) is read
here once, ``"auto"`` scheduler step counts are filled from ``--steps`` (as the HF Trainer does),
and the whole resolved set is written to ``RUN_DIR/run_config.json`` (``train.outputs.resolved``):
a run is reproducible with ``shardwise train --run-config RUN_DIR/run_config.json``.
"""

from __future__ import annotations

import argparse
import difflib
import json
import tomllib
from pathlib import Path
from typing import Any

from shardwise.errors import OneLineParser, UserError
from shardwise.train.defaults import SUMMARY, default_config
from shardwise.train.outputs import check_run_folder
from shardwise.train.presets import MODEL_PRESETS, REPO_DATA

EPILOG = """examples:
  shardwise train --model llama-micro --data data/sonnets.txt --steps 40 --out runs/first   (no --config: defaults)
  shardwise launch --nproc 2 -- train --config examples/zero2_llama.json --steps 60 --out runs/zero2
  shardwise launch --nproc 2 -- train --config ds.json --model ./my_hf_model --data corpus.jsonl \\
      --out runs/mine --steps 2000 --save-every 200 --eval-every 100 --resume auto
  shardwise launch --nproc 4 -- train --run-config runs/mine/run_config.json --resume auto
SIGTERM or Ctrl-C finishes the current step, saves a checkpoint and exits 0; --resume auto continues
from it (also at another world size, ZeRO stage or TP degree) at the same data position."""


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="shardwise train", epilog=EPILOG,
                      formatter_class=argparse.RawDescriptionHelpFormatter,
                      description="Train any causal LM on local text under a DeepSpeed-style "
                                            "config: checkpoints, resume, eval, metrics, plot, HF export.")
    a = p.add_argument
    a("--run-config", help="TOML or JSON file with any of these options (flags override it)")
    a("--config", help="DeepSpeed-style JSON config (batch sizes, optimizer, ZeRO stage, TP); default: "
                       f"{SUMMARY.replace('%', '%%')} (docs/train.md)")
    a("--model", default="llama-tiny",
      help=f"a preset ({', '.join(MODEL_PRESETS)}), a local HF folder, or a config.json (from scratch)")
    a("--data", default=str(REPO_DATA), help="a text file, a folder of text files, JSONL with a text field, or a "
      "Hugging Face dataset: a save_to_disk folder, .parquet/.arrow files, a hub name in the local cache")
    a("--text-key", default="text", help="the JSONL field or dataset column holding the text (default: text)")
    a("--out", default="runs/default", help="run folder: metrics, checkpoints, plot, hf/ export")
    a("--steps", type=int, default=400,
      help="optimizer steps in total, those before a resume included (resumed at step 300 with --steps 400: 100 more)")
    a("--seq", type=int, default=128, help="tokens per sequence")
    a("--seed", type=int, default=1234, help="model init and data order")
    a("--eval-fraction", type=float, default=0.1, help="share of the sequences held out for eval (0: none)")
    a("--eval-every", type=int, default=100, help="eval every N steps and at the end (0: only at the end)")
    a("--save-every", type=int, default=100, help="checkpoint every N steps and at the end (0: only at the end)")
    a("--keep", type=int, default=2, help="checkpoints to keep (oldest deleted; 0 keeps all)")
    a("--max-nonfinite-steps", type=int, default=None,
      help="steps with a NaN/inf loss or gradient norm skipped before the run stops (exit 3); default: the "
           "config's shardwise.max_nonfinite_steps, 0 (fp16 loss-scale skips never count)")
    a("--resume", default="none", help="'auto': continue from the latest checkpoint in --out; 'none': start "
                                       "fresh (refused when --out has checkpoints)")
    a("--sample-tokens", type=int, default=200, help="tokens to generate at the end (0: no sample)")
    a("--prompt", default=None, help="prompt for the sample (default: the start of the held-out text)")
    a("--no-export", action="store_true", help="skip the hf/ export at the end")
    a("--overwrite", action="store_true", help="--out may hold files that are not a run's (they are left alone)")
    a("--sp", type=int, default=None,
      help="Ulysses sequence parallelism over N consecutive ranks (the config's sequence_parallel_size)")
    a("--ep", type=int, default=None,
      help="expert parallelism for an HF MoE model: split each MoE layer's experts over N ranks "
           "(sets the config's expert_parallel section; docs/moe.md)")
    a("--pp", type=int, default=None,
      help="pipeline parallelism: the model split by decoder layers into N stages (the config's pipeline.stages; "
           "docs/pipeline.md)")
    a("--timeout", type=float, default=None,
      help="seconds a collective may wait for the other ranks before failing (default: SHARDWISE_TIMEOUT or 600)")
    return p


def _file_values(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    f = Path(path)
    if not f.is_file():
        parser.error(f"--run-config {path}: no such file")
    try:
        raw = tomllib.loads(f.read_text()) if f.suffix == ".toml" else json.loads(f.read_text())
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        parser.error(f"--run-config {path}: cannot parse ({e})")
    if not isinstance(raw, dict):
        parser.error(f"--run-config {path}: the top level must be a table/object of options")
    actions = {act.dest: act for act in parser._actions if act.dest not in ("help", "run_config")}
    out = {}
    for key, value in raw.items():
        dest = key.replace("-", "_")
        if dest not in actions:
            close = difflib.get_close_matches(dest, actions, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            parser.error(f"--run-config {path}: unknown option '{key}'{hint}")
        wrong = type_error(actions[dest], value)
        if wrong:
            parser.error(f"--run-config {path}: '{key}' must be {wrong}, got {value!r} "
                         f"({type(value).__name__})")
        out[dest] = value
    return out


def type_error(action: argparse.Action, value: Any) -> str | None:
    """What ``value`` from a run config file must be for ``action`` (None when it is that).

    argparse converts only strings, so a file's values are checked here against the flag's type:
    a whole number where the flag takes one (``steps = 2.5`` would train 3 steps), a number where
    it takes a float, true/false for a switch, text for the rest (``config`` may also be a table).
    None is accepted where None is the flag's default (``prompt``, ``timeout``).
    """
    if value is None and action.default is None:
        return None
    if action.nargs == 0:  # a switch (store_true)
        return None if isinstance(value, bool) else "true or false"
    if action.type is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "a whole number"
    if action.type is float:
        return None if isinstance(value, int | float) and not isinstance(value, bool) else "a number"
    if action.dest == "config" and isinstance(value, dict):
        return None
    return None if isinstance(value, str) else "text (a string)"


def _validate(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    if args.steps <= 0:
        p.error(f"--steps must be > 0, got {args.steps}")
    if args.seq < 2:  # a sequence of one token has nothing to predict: the loss would be NaN
        p.error(f"--seq must be >= 2 (each token predicts the next), got {args.seq}")
    for name in ("eval_every", "save_every", "keep", "sample_tokens", "max_nonfinite_steps"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if not 0 <= args.eval_fraction < 1:
        p.error(f"--eval-fraction must be in [0, 1), got {args.eval_fraction}")
    if args.timeout is not None and not 0 < args.timeout < 7 * 24 * 3600:
        p.error(f"--timeout must be between 0 and one week in seconds, got {args.timeout}")
    if args.resume not in ("auto", "none"):
        p.error(f"--resume must be 'auto' or 'none', got {args.resume!r}")


def read_ds_config(config: str | dict, steps: int, p: argparse.ArgumentParser) -> dict:
    """The DeepSpeed config as a dict, with ``"auto"`` scheduler step counts set to ``steps``."""
    if isinstance(config, dict):
        ds = json.loads(json.dumps(config))
    else:
        f = Path(config)
        if not f.is_file():
            p.error(f"--config {config}: no such file")
        try:
            ds = json.loads(f.read_text())
        except json.JSONDecodeError as e:
            p.error(f"--config {config}: not valid JSON ({e.msg} at line {e.lineno})")
    params = (ds.get("scheduler") or {}).get("params") or {}
    if params.get("total_num_steps") == "auto":
        params["total_num_steps"] = steps
    return ds


def _apply_sp(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    """``--sp N`` as the config's ``sequence_parallel_size`` (a different value in the config is refused)."""
    if args.sp is None:
        return
    if args.sp < 1:
        p.error(f"--sp must be >= 1, got {args.sp}")
    given = args.ds_config.get("sequence_parallel_size")
    if given not in (None, args.sp):
        p.error(f"--sp {args.sp} disagrees with the config's sequence_parallel_size {given}; keep one")
    args.ds_config["sequence_parallel_size"] = args.sp


def _apply_pp(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    """``--pp N`` as the config's ``pipeline.stages`` (a different value in the config is refused)."""
    if args.pp is None:
        return
    if args.pp < 1:
        p.error(f"--pp must be >= 1, got {args.pp}")
    section = args.ds_config.get("pipeline") or {}
    if section.get("stages") not in (None, "auto", args.pp):
        p.error(f"--pp {args.pp} disagrees with the config's pipeline.stages {section['stages']}; keep one")
    args.ds_config["pipeline"] = {**section, "stages": args.pp}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Flags over the run config file over the defaults; ``args.ds_config`` is the config dict."""
    p = build_parser()
    first, _ = p.parse_known_args(argv)
    if first.run_config:
        p.set_defaults(**_file_values(first.run_config, p))
    args = p.parse_args(argv)
    _validate(args, p)
    try:  # before any work: --out a file, inside --data, or holding other files
        check_run_folder(Path(args.out), args.data, args.overwrite)
    except UserError as e:
        p.error(str(e))
    config = default_config(args.steps) if args.config is None else args.config  # no --config: the defaults
    args.ds_config = read_ds_config(config, args.steps, p)
    _apply_sp(args, p)
    _apply_pp(args, p)
    if args.ep is not None:  # DeepSpeed AutoEP's keys, as a config would give them
        if args.ep < 1:
            p.error(f"--ep must be >= 1, got {args.ep}")
        args.ds_config["expert_parallel"] = {**(args.ds_config.get("expert_parallel") or {}),
                                             "enabled": True, "autoep_size": args.ep}
    if args.timeout is None:  # the flag wins; else the config's shardwise.timeout_s, as initialize() reads it
        from shardwise.config.read import timeout_of  # here, not at the top: `train --help` loads no torch
        from shardwise.config.schema import ConfigError

        try:
            args.timeout = timeout_of(args.ds_config)
        except ConfigError as e:
            p.error(f"--config: {e}")
    return args
