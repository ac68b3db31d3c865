"""Ulysses attention for HF models: registered as an attention implementation that wraps sdpa or eager.

Around the model's own attention function, q/k/v go from sequence-sharded to head-sharded by one
all-to-all each (``exchange.SeqToHead``), the wrapped function attends over the whole sequence with
``heads / sp`` heads, and the output comes back sequence-sharded by one more (``HeadToSeq``).
Nothing else in the model changes: projections, rotary (from the shard's ``position_ids``), MLPs
and norms act per token. Causality is applied over the whole sequence (the wrapped function gets no
mask, or eager's full causal one): the data adapter removes right padding (harmless under a causal
mask) and refuses any other mask, so there is no local mask to honour.

GQA: key/value heads are split when the SP degree divides them; when the degree is a multiple of
them each kv head is copied to the ranks whose query heads use it (``repeat_interleave``, whose
backward sums the copies' gradients). Other head counts are served by ring attention
(``ring.py``): ``choose_attention`` picks Ulysses when it can split the heads and the ring otherwise
(``shardwise.sequence_parallel_attention: "auto"``), or the one asked for.

Under tensor parallelism the attention module already holds ``heads / tp`` query and kv heads (the
TP plan cut q/k/v by heads); the SP group is the ranks with the same TP rank, so the exchange splits
those local heads by the SP degree, and the rules above apply to the TP-local counts.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.comm import Work, compute_device
from shardwise.sequence_parallel.exchange import HeadToSeq, SeqToHead
from shardwise.sequence_parallel.group import SequenceParallel, set_current
from shardwise.sequence_parallel.ring import layout_problem, ring_attention
from shardwise.sequence_parallel.saved_once import saved_once_attention
from shardwise.tensor_parallel import tp_state_of

PREFIX = "shardwise_sp_"
MODES = ("auto", "ulysses", "ring")
WRAPPABLE = ("sdpa", "eager")
_CURRENT: dict[str, SequenceParallel] = {}  # registered name -> the SP group its attention uses
_CHECKS: dict[int, tuple[Work | None, torch.Tensor, str | None]] = {}  # id(sp) -> this forward's shard check, in flight
_MASK: dict[tuple, torch.Tensor] = {}  # (length, dtype, device) -> eager's causal mask; one entry


def head_split(num_heads: int, num_kv_heads: int, sp_size: int, tp_size: int = 1) -> int:
    """How many copies of each kv head the exchange sends (1: kv heads split like query heads).

    ``num_heads`` / ``num_kv_heads``: the model's; under tensor parallelism (``tp_size`` > 1) each
    rank holds ``1 / tp_size`` of both, and the rule applies to those TP-local counts.
    Raises ValueError, in one line, for head counts Ulysses cannot split."""
    if num_heads % tp_size or num_kv_heads % tp_size:
        raise ValueError(f"tensor parallel size {tp_size} must divide the attention heads: "
                         f"num_attention_heads={num_heads}, num_key_value_heads={num_kv_heads}")
    heads, kv = num_heads // tp_size, num_kv_heads // tp_size
    per_tp = (f" per tensor-parallel rank ({num_heads} and {num_kv_heads} over tensor parallel {tp_size})"
              if tp_size > 1 else "")
    if heads % sp_size:
        raise ValueError(f"sequence parallelism: {heads} attention heads{per_tp} cannot be split over "
                         f"{sp_size} ranks (sequence_parallel_size must divide num_attention_heads"
                         f"{' / autotp_size' if tp_size > 1 else ''})")
    if kv % sp_size == 0:
        return 1
    if sp_size % kv == 0:
        return sp_size // kv
    raise ValueError(f"sequence parallelism: {kv} key/value heads{per_tp} cannot be split over or "
                     f"replicated to {sp_size} ranks (sequence_parallel_size must divide num_key_value_heads"
                     f"{' / autotp_size' if tp_size > 1 else ''} or be a multiple of it)")


def choose_attention(mode: str, num_heads: int, num_kv_heads: int, sp_size: int, tp_size: int = 1) -> str:
    """``"ulysses"`` or ``"ring"`` for the requested ``mode``: "auto" takes Ulysses when it can split
    the heads (fewer, larger messages per layer) and the ring otherwise; "ulysses" refuses, in one
    line, head counts it cannot split."""
    if mode not in MODES:
        raise ValueError(f"shardwise.sequence_parallel_attention must be one of {MODES}, not {mode!r}")
    if mode == "ring" or (mode == "auto" and _ulysses_refuses(num_heads, num_kv_heads, sp_size, tp_size)):
        if tp_size > 1:  # not proven together: refused rather than trusted
            raise ValueError(f"ring attention with tensor parallelism ({tp_size}) is not implemented by shardwise; "
                             f"choose head counts Ulysses splits ({num_heads} heads, {num_kv_heads} kv heads "
                             f"over tensor parallel {tp_size} x sequence parallel {sp_size})")
        return "ring"
    head_split(num_heads, num_kv_heads, sp_size, tp_size)  # "ulysses": its one-line refusal
    return "ulysses"


def _ulysses_refuses(num_heads: int, num_kv_heads: int, sp_size: int, tp_size: int) -> bool:
    try:
        head_split(num_heads, num_kv_heads, sp_size, tp_size)
    except ValueError:
        return True
    return False


class _Heads:
    """The attention module as the wrapped function sees it after the exchange: the same module
    with the local ratio of query to kv heads (HF's sdpa/eager read ``num_key_value_groups``)."""

    def __init__(self, module: nn.Module, groups: int):
        self._module = module
        self.num_key_value_groups = groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _eager_of(module: nn.Module) -> Callable:
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise ValueError(f"sequence parallelism over eager attention: {type(module).__name__}'s module has no "
                         "eager_attention_forward; use attn_implementation='sdpa'")
    return fn


def _causal(n: int, like: torch.Tensor) -> torch.Tensor:
    """Eager's additive causal mask over the gathered sequence, built once per length (a pure function of
    ``n``, dtype and device, so reusing it across layers, recomputes and steps is exact); one entry
    kept: a new length replaces it, so at most one ``n x n`` mask lives between forwards."""
    key = (n, like.dtype, like.device)
    mask = _MASK.get(key)
    if mask is None:
        mask = torch.full((n, n), torch.finfo(like.dtype).min, dtype=like.dtype, device=like.device)
        mask = mask.triu(1)[None, None]
        _MASK.clear()
        _MASK[key] = mask
    return mask


def _inner(name: str, module: nn.Module) -> Callable:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return _eager_of(module) if name == "eager" else ALL_ATTENTION_FUNCTIONS[name]


def _refuse_local_windows_and_sinks(module: nn.Module, seq: int, kwargs: dict) -> None:
    """Refuse (one line) what the whole-sequence causal attention would silently drop: a sliding
    window shorter than the gathered sequence (Mistral, Qwen2, Gemma, GPT-OSS layers; a window at
    least as long as the sequence masks nothing), and per-head attention sinks (GPT-OSS's ``s_aux``,
    one per head, while a rank holds ``heads / N`` of them)."""
    window = kwargs.get("sliding_window")
    if window is not None and seq > window:
        raise ValueError(f"sequence parallelism: {type(module).__name__} has a sliding window of {window} tokens, "
                         f"shorter than the {seq}-token sequence; sliding-window attention under SP is not "
                         "supported yet (train without sequence_parallel_size, or with sequences <= the window)")
    if kwargs.get("s_aux") is not None:
        raise ValueError(f"sequence parallelism: {type(module).__name__} has attention sinks (s_aux); attention "
                         "with sinks under SP is not supported yet (train without sequence_parallel_size)")


def _ulysses(inner_name: str, sp: SequenceParallel, module: nn.Module, query: torch.Tensor,
             key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None, **kwargs: Any):
    inner = _inner(inner_name, module)
    if not sp.active():
        return inner(module, query, key, value, attention_mask, **kwargs)
    _refuse_local_windows_and_sinks(module, query.shape[2] * sp.size, kwargs)
    if sp.attention == "ring":  # the ring masks by global token index; the model's mask comes from the
        # shard's zigzag position_ids alone (the forward pre-hook refuses an attention_mask)
        _await_shard_check(sp)
        return ring_attention(module, query, key, value, sp.comm, sp.layout, **kwargs), None
    if inner_name == "sdpa" and attention_mask is not None:
        raise ValueError("sequence parallelism: the model built an attention mask for a sequence-split batch "
                         "(padding or packed sequences); split batches with shardwise.sequence_parallel."
                         "split_batch, which removes right padding and refuses other masks")
    _await_shard_check(sp)
    copies = head_split(query.shape[1], key.shape[1], sp.size)
    if torch.is_grad_enabled() and not kwargs.get("dropout"):  # dropout: a recompute would draw other masks
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            mask = _causal(q.shape[2], q) if inner_name == "eager" else None
            return inner(_Heads(module, q.shape[1] // k.shape[1]), q, k, v, mask, **kwargs)[0].transpose(1, 2)

        return saved_once_attention(attend, sp.comm, copies, query, key, value).transpose(1, 2).contiguous(), None
    if copies > 1:
        key, value = key.repeat_interleave(copies, dim=1), value.repeat_interleave(copies, dim=1)
    q, k, v = (SeqToHead.apply(t, sp.comm) for t in (query, key, value))
    mask = _causal(q.shape[2], q) if inner_name == "eager" else None
    out, _ = inner(_Heads(module, q.shape[1] // k.shape[1]), q, k, v, mask, **kwargs)  # [b, S, h/sp, d]
    out = HeadToSeq.apply(out.transpose(1, 2), sp.comm).transpose(1, 2).contiguous()
    return out, None


def _attention_for(inner_name: str) -> Callable:
    name = PREFIX + inner_name

    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, **kwargs: Any):
        return _ulysses(inner_name, _CURRENT[name], module, query, key, value, attention_mask, **kwargs)

    attention.__name__ = name
    return attention


def _await_shard_check(sp: SequenceParallel) -> None:
    """Before this forward's first exchange: finish the shard check the pre-hook started; refuse unequal
    lengths in one line (later layers and the recompute in backward find nothing pending)."""
    pending = _CHECKS.pop(id(sp), None)
    if pending is None:
        return
    work, lengths, problem = pending
    if work is not None:
        work.wait()
    high, low = int(lengths[0]), -int(lengths[1])
    if high != low:
        raise ValueError(f"sequence parallelism: the SP ranks' sequence shards differ in length "
                         f"({low}..{high} tokens); split_batch pads them equal")
    if int(lengths[2]):
        raise ValueError(problem or "ring attention: another SP rank's shard does not fit the zigzag layout; "
                         "feed batches from shardwise.sequence_parallel.split_batch")


def _check_split_forward(sp: SequenceParallel) -> Callable:
    """A forward pre-hook: a forward that will exchange heads must get equal shards with positions.

    Why: with SP on, an unsplit batch (the same whole sequence on every rank) would be attended as
    one sequence ``sp`` times as long, a silent wrong number; and shards of unequal length would
    deadlock the all-to-all (or, on NCCL, exchange wrong bytes). ``split_batch`` gives
    ``position_ids`` and equal lengths; one tiny all-reduce per forward checks the lengths (and, for
    ring attention, that every rank's shard is in the zigzag layout: contiguous shards would be masked
    as the wrong tokens, silently), started here without waiting and finished before the first
    exchange (``_await_shard_check``), so its latency overlaps the embeddings and the first
    projections. It is not cached by length: a rank whose length is cached would skip the collective
    while a rank with a new (unequal) length runs it, the very mismatch it is there to catch; a skip
    must be decided alike on every rank, and only a collective can tell the ranks' lengths apart. A
    model split over TP after registration must match the TP degree the groups were cut for
    (``_check_tp``). It also turns the KV cache off (``use_cache=False``) for a forward with SP on:
    see ``_without_cache``."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not sp.active():
            return None
        _check_tp(module, sp)  # TP applied after registration (shard(tp_plan=...)) with groups cut for another degree
        ids = kwargs.get("input_ids", args[0] if args else None)
        ids = kwargs.get("inputs_embeds") if ids is None else ids
        if ids is None or kwargs.get("position_ids") is None:
            raise ValueError("sequence parallelism: a forward with gradients (SP on) got no position_ids; "
                             "feed batches from shardwise.sequence_parallel.split_batch, or run whole "
                             "sequences inside sp.disabled()")
        stale = _CHECKS.pop(id(sp), None)  # a forward that failed before its first exchange
        if stale is not None and stale[0] is not None:
            stale[0].wait()
        problem = layout_problem(kwargs, sp.rank, sp.size, ids.shape[1]) if sp.attention == "ring" else None
        # on the compute device: an NCCL group reduces no CPU tensor
        lengths = torch.tensor([ids.shape[1], -ids.shape[1], problem is not None], dtype=torch.int64,
                               device=compute_device())
        work = sp.comm.all_reduce(lengths, op=dist.ReduceOp.MAX, async_op=True)  # any rank's problem, on all
        _CHECKS[id(sp)] = (work, lengths, problem)
        return _without_cache(module, args, kwargs)

    return hook


def _without_cache(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """The forward's arguments with ``use_cache=False`` when its ``forward`` takes ``use_cache``.

    Why here and not in the batch: a forward with SP on trains on a shard, so a KV cache would only
    keep each layer's shard keys and values alive (memory, no use: the next token of a shard is on
    another rank); the batches stay tensors only, as DeepSpeed's adapter yields them, so a loop that
    moves every value with ``.to(device)`` runs. Same number as the batch's ``use_cache=False`` gave."""
    if "use_cache" not in inspect.signature(module.forward).parameters:
        return None
    return args, {**kwargs, "use_cache": False}


def _check_tp(model: nn.Module, sp: SequenceParallel) -> None:
    """A TP-sliced model needs SP groups cut for its TP degree: groups of consecutive ranks would
    exchange heads between TP ranks that hold different heads (a silent wrong attention)."""
    state = tp_state_of(model)
    tp = state.comm.size if state is not None else 1
    if tp > 1 and tp != sp.tp_size:
        raise ValueError(f"sequence parallelism: the model is split over tensor parallel {tp} but the SP groups "
                         f"were cut for tensor parallel {sp.tp_size}; pass tp_size={tp} to "
                         "setup_sequence_parallel or SequenceParallel.of_size")


def register_attention(model: nn.Module, sp: SequenceParallel, attention: str = "auto") -> str:
    """Make ``model``'s attention sequence-parallel over ``sp``; returns the registered name.

    ``attention``: "auto", "ulysses" or "ring" (``choose_attention``; sets ``sp.attention`` and the
    shard layout ``sp.layout`` that ``split_batch`` follows). Checks the head counts first (one-line
    ValueError). Idempotent: registering a model again rebinds it to ``sp``. Installs the shard
    check (``_check_split_forward``) on ``model``."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    current = config._attn_implementation or "eager"
    inner_name = current[len(PREFIX):] if current.startswith(PREFIX) else current
    if inner_name not in WRAPPABLE:
        raise ValueError(f"sequence parallelism wraps attn_implementation 'sdpa' or 'eager', not {inner_name!r}")
    _check_tp(model, sp)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    sp.attention = choose_attention(attention, heads, kv_heads, sp.size, sp.tp_size)
    sp.layout = "zigzag" if sp.attention == "ring" else "contiguous"
    name = PREFIX + inner_name
    _CURRENT[name] = sp
    set_current(sp)
    AttentionInterface.register(name, _attention_for(inner_name))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner_name])
    for cfg in {id(c): c for c in (model.config, config)}.values():
        cfg._attn_implementation = name
    old = model.__dict__.pop("_shardwise_sp_check", None)
    if old is not None:
        old.remove()
    model.__dict__["_shardwise_sp_check"] = model.register_forward_pre_hook(_check_split_forward(sp),
                                                                           with_kwargs=True)
    return name
