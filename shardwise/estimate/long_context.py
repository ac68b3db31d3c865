"""The longest sequence a memory budget allows under Ulysses SP, with and without ALST tiling.

Why a formula and not a table: `docs/long_context.md` measured one small Llama; a user needs the
answer for their model, SP degree and device. Per rank, with ``t = seq / sp`` tokens (micro batch 1)
(Ulysses splits every per-token activation by ``sp``), all in elements of the activation dtype:

- saved for backward, every layer (HF Llama's forward under shardwise, storage by storage): the two
  RMSNorms' input, normalized value and ``1/rms`` (``2 * (2h + 1)``), q before and after rotary,
  the attention output and the MLP's input (``4h``), k and v at their kv width (``2 * kv * d``,
  ``d = h / heads``), and at SP 1 sdpa's log-sum-exp (``heads``; under Ulysses shardwise redoes the
  attention in backward instead); untiled, the gated MLP's ``4 * ffn`` too (gate, up, ``act(gate)``,
  their product; ALST's tiled MLP keeps only its input and recomputes the rest);
- saved once: rotary cos and sin (``2d``), the final norm (``2h + 1``), the head's input (``h``),
  the int64 input ids and labels (16 bytes), and untiled the ``[t, vocab]`` logits;
- the backward's transients on top (the heap peak): untiled, the logits' gradient and the softmax,
  ``2 * t * vocab``; tiled, one tile's logits ``tile * vocab`` (``tile = t / ceil(t / h)``, ALST's
  one tile per ``h`` tokens), the head's weight gradient ``vocab * h`` before it is added in, and
  the hidden states' gradient ``t * h``.

Nothing is fitted: every term follows from the model's shape (tests/test_long_context_estimate.py
holds it to every point of benchmarks/results/long_context.json).
The static part (parameters, gradients, optimizer states per rank) is `memory.model_state_bytes`.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

from shardwise.errors import UserError
from shardwise.estimate.memory import ModelFacts
from shardwise.files.safe import read_regular

# Architectures whose layer is the one the formula counts: RMSNorm, rotary q/k, gated (SwiGLU) MLP.
GATED_LLAMA_TYPES = frozenset({"llama", "mistral", "qwen2"})


@dataclass(frozen=True)
class ActivationBytes:
    """Per-rank activation bytes at one length: held at the start of backward, and the peak."""

    tokens_per_rank: int
    saved: int
    peak: int


def check_shape(facts: ModelFacts, sp: int) -> None:
    """Refuse what the formula does not describe, naming the reason (never a silent wrong number)."""
    if facts.model_type not in GATED_LLAMA_TYPES:
        raise ValueError(f"model_type {facts.model_type!r}: the longest-sequence formula counts a Llama-style "
                         f"layer ({', '.join(sorted(GATED_LLAMA_TYPES))})")
    if not facts.intermediate_size:
        raise ValueError("the model config has no intermediate_size (the MLP's width)")
    if not facts.num_heads or facts.hidden_size % facts.num_heads:
        raise ValueError(f"hidden_size {facts.hidden_size} is not a multiple of the {facts.num_heads} heads")
    if facts.num_heads % sp:
        raise ValueError(f"--sp {sp} does not divide the model's {facts.num_heads} attention heads (Ulysses)")


def tile_tokens(tokens: int, hidden: int) -> int:
    """The largest of ALST's tiles: ``ceil(t / h)`` tiles, the first ones ``ceil(t / n)`` tokens."""
    n = max(1, math.ceil(tokens / hidden))
    return math.ceil(tokens / n)


def saved_per_token(facts: ModelFacts, sp: int, tiled: bool) -> tuple[int, int]:
    """(activation-dtype elements, other bytes) saved for backward per token per rank (module docstring)."""
    h, heads, v, ffn = facts.hidden_size, facts.num_heads, facts.vocab_size, facts.intermediate_size or 0
    d = h // heads
    layer = 2 * (2 * h + 1) + 4 * h + 2 * facts.num_kv_heads * d + (heads if sp == 1 else 0)
    if not tiled:
        layer += 4 * ffn
    once = 2 * d + (2 * h + 1) + h + (0 if tiled else v)
    return facts.num_layers * layer + once, 16


def activation_bytes(facts: ModelFacts, tokens_per_rank: int, tiled: bool, sp: int = 1,
                     elem: int = 4) -> ActivationBytes:
    """Saved-for-backward and peak activation bytes on one rank holding ``tokens_per_rank`` tokens."""
    t, h, v = tokens_per_rank, facts.hidden_size, facts.vocab_size
    elems, other = saved_per_token(facts, sp, tiled)
    if tiled:
        transient = tile_tokens(t, h) * v + v * h + t * h
    else:
        transient = 2 * t * v
    saved = t * (elems * elem + other)
    return ActivationBytes(t, saved, saved + transient * elem)


def longest_sequence(facts: ModelFacts, sp: int, tiled: bool, budget: int, static: int = 0,
                     counted: str = "peak", elem: int = 4) -> int:
    """The longest sequence (micro batch 1, whole over the SP group: a multiple of ``sp``) whose
    per-rank ``static`` bytes plus activations (``counted``: "peak" or "saved") fit ``budget``; 0 when
    not even ``sp`` tokens do.

    The tiled peak is not monotone (its tile term drops where ALST adds a tile), so a bisection on it
    could stop short. ``upper`` (the tile term at its largest, ``min(t, h)``) is monotone and at least
    the need; ``upper - slack`` (slack: ``h * vocab``, more than any tile's drop) is monotone and at most
    it. The answer lies between their crossings: bisect the lower one, then step down to the last fit."""
    check_shape(facts, sp)
    h, v = facts.hidden_size, facts.vocab_size
    peak = counted == "peak"

    def need(t: int) -> int:
        a = activation_bytes(facts, t, tiled, sp, elem)
        return static + (a.peak if peak else a.saved)

    def upper(t: int) -> int:
        return need(t) + ((min(t, h) - tile_tokens(t, h)) * v * elem if tiled and peak else 0)

    slack = h * v * elem if tiled and peak else 0
    lo, hi = 0, 1
    while upper(hi) - slack <= budget:
        lo, hi = hi, hi * 2
        if hi > 1 << 40:
            raise ValueError("the budget allows an unbounded length: check --budget")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if upper(mid) - slack <= budget else (lo, mid)
    while lo > 0 and need(lo) > budget:  # no t > lo fits: upper(t) - slack <= need(t) exceeds the budget
        lo -= 1
    return lo * sp


def add_long_context_args(p: argparse.ArgumentParser) -> None:
    """The longest-sequence flags on `shardwise estimate` (``--budget`` turns them on)."""
    g = p.add_argument_group("longest sequence under Ulysses SP (--budget turns it on; needs --model, --dtype fp32)")
    g.add_argument("--budget", type=_size, help="memory per rank, e.g. 80GB, 384MiB")
    g.add_argument("--sp", type=_degree, default=1, help="Ulysses SP degree: each rank holds seq/sp tokens")
    g.add_argument("--tiled", action="store_true", help="ALST tiling: tiled MLP and tiled logits + loss")
    g.add_argument("--count", choices=["peak", "saved"], default="peak",
                   help="peak: activations + the backward's transients (default); saved: what autograd "
                        "holds at the start of backward")
    g.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=3,
                   help="ZeRO stage over --devices for the model state taken off the budget first")
    g.add_argument("--activations-only", action="store_true",
                   help="the budget is for activations alone (model state not subtracted), as the benchmark counts")


def config_head_dim(src: str) -> int | None:
    """``head_dim`` of a model folder's or file's config.json (its text config's), if it sets one."""
    path = Path(src) / "config.json" if Path(src).is_dir() else Path(src)
    data = json.loads(read_regular(path, 64 << 20).decode("utf-8"))
    section = data.get("text_config", data) if isinstance(data.get("text_config"), dict) else data
    value = section.get("head_dim")
    return value if isinstance(value, int) else None


def _degree(text: str) -> int:
    if not text.strip().isdigit() or not 0 < int(text) <= 1 << 20:
        raise argparse.ArgumentTypeError(f"must be a whole number from 1 to {1 << 20}: {text!r}")
    return int(text)


def _size(text: str) -> int:
    from shardwise.estimate.memory import parse_bytes

    try:
        v = parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    if not 0 < v < 1 << 60:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return v


def run_long_context(p: argparse.ArgumentParser, args: argparse.Namespace, facts: ModelFacts | None) -> int:
    """Print the longest sequence for the flags; exit 2 with one line for what it cannot serve."""
    try:
        return _report(args, facts)
    except UserError as exc:
        try:
            p.error(str(exc))
        except SystemExit as stop:
            return int(stop.code or 2)
    return 2


def _report(args: argparse.Namespace, facts: ModelFacts | None) -> int:
    from shardwise.estimate.memory import model_state_bytes

    if facts is None:
        raise UserError("--budget needs --model (hidden size, layers, vocab, MLP width)")
    if args.seq is not None or args.micro_batch is not None:
        raise UserError("--budget finds the length for micro batch 1: drop --seq and --micro-batch")
    if args.dtype != "fp32":
        raise UserError(f"--budget: the longest-sequence formula is checked for --dtype fp32 only, not {args.dtype}")
    if args.devices % args.sp:
        raise UserError(f"--sp {args.sp} does not divide --devices {args.devices}")
    head_dim = config_head_dim(args.model)
    if head_dim and head_dim * facts.num_heads != facts.hidden_size:
        raise UserError(f"--model: head_dim {head_dim} x {facts.num_heads} heads is not hidden_size "
                        f"{facts.hidden_size}; the longest-sequence formula assumes head_dim = hidden / heads")
    static = 0 if args.activations_only else model_state_bytes(
        facts.params, args.devices, args.dtype, args.zero_stage, args.offload)[0]
    try:
        seq = longest_sequence(facts, args.sp, args.tiled, args.budget, static, args.count)
    except ValueError as exc:
        raise UserError(f"--model: {exc}") from exc
    act = activation_bytes(facts, seq // args.sp, args.tiled, args.sp)
    out = {"longest_seq": seq, "tokens_per_rank": seq // args.sp, "sp": args.sp, "tiled": args.tiled,
           "counted": args.count, "budget_bytes": args.budget, "model_state_bytes": static,
           "saved_bytes": act.saved, "peak_bytes": act.peak}
    if args.json:
        print(json.dumps(out))
        return 0
    mib = 2**20
    print(f"longest sequence: {seq} tokens ({seq // args.sp} per rank, SP {args.sp}, "
          f"ALST tiling {'on' if args.tiled else 'off'}, micro batch 1)")
    state = ("model state not counted (--activations-only)" if args.activations_only else
             f"model state {static / mib:.1f} MiB (ZeRO-{args.zero_stage} over {args.devices})")
    print(f"per rank there: {state}, "
          f"activations saved {act.saved / mib:.1f} MiB, peak {act.peak / mib:.1f} MiB; "
          f"budget {args.budget / mib:.1f} MiB ({args.count})")
    return 0
