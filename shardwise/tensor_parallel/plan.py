"""Read a tensor-parallel plan for an HF causal LM and apply it in place.

Plan sources, in order (the report names the one used, since a silent fallback is how AutoTP-style
string matching breaks when a model changes):

1. ``plan=`` given by the caller ("user plan");
2. the model's own plan ("model tp plan"): ``config.base_model_tp_plan`` (prefixed with the base
   model's attribute) plus the head class's ``_tp_plan`` (``{"lm_head": "colwise_gather_output"}``);
3. a built-in plan for GPT-2, whose fused ``c_attn`` is cut per q/k/v part ("built-in gpt2 plan");
4. leaf-name matching of common projection names ("name fallback").

Input embeddings are always vocab-parallel; a head tied to them shares the sharded weight.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from shardwise.comm import Comm, compute_device
from shardwise.tensor_parallel.cross_entropy import causal_lm_loss
from shardwise.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardSpec,
    SharedCopy,
    VocabParallelEmbedding,
    vocab_head_sharing,
)

GPT2_PLAN = {  # relative to GPT2Model; c_attn holds q|k|v, each cut by heads
    "h.*.attn.c_attn": "colwise_qkv",
    "h.*.attn.c_proj": "rowwise",
    "h.*.mlp.c_fc": "colwise",
    "h.*.mlp.c_proj": "rowwise",
}
_FALLBACK_COL = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "query", "key", "value", "fc1",
                 "w1", "w3", "wq", "wk", "wv", "fc_in"}
_FALLBACK_ROW = {"o_proj", "out_proj", "down_proj", "fc2", "w2", "wo", "fc_out"}
_HEAD_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "n_heads", "n_kv_heads", "n_head")
_PARTS = {"colwise_qkv": 3, "packed_colwise": 2}
SUPPORTED = ("colwise", "rowwise", "colwise_gather_output", "embedding_rowwise", "packed_colwise",
             "replicated_with_grad_allreduce", "colwise_qkv")


@dataclass
class TPReport:
    """What :func:`apply_tensor_parallel` did; the engine uses it for norms, ZeRO and checkpoints.

    ``sharded``: parameter name -> :class:`ShardSpec` (also on the parameter as ``p._tp_spec``);
    ``replicated``: names of parameters every TP rank holds whole (identical values and, with the
    f/g functions, identical grads: count them once in a global norm); ``partial_grad``: replicated
    parameters whose grads are all-reduced over TP by a hook (``replicated_with_grad_allreduce``).
    """

    plan_source: str
    tp_size: int
    modules: dict[str, str] = field(default_factory=dict)
    sharded: dict[str, ShardSpec] = field(default_factory=dict)
    replicated: list[str] = field(default_factory=list)
    partial_grad: list[str] = field(default_factory=list)
    tied: bool = False


_TP_SLOT = "_shardwise_tp"  # where a TP-sliced model keeps its TPState (read through tp_state_of)


@dataclass
class TPState:
    """What a TP-sliced model carries: the report, the TP group, and the bytes its slices cost to read."""

    report: TPReport
    comm: Comm
    bytes_loaded: int = 0  # read from safetensors by tensor_parallel.inference (0: sliced in place)


def tp_state_of(model: nn.Module) -> TPState | None:
    """The model's :class:`TPState`, None when :func:`apply_tensor_parallel` has not sliced it."""
    return model.__dict__.get(_TP_SLOT)


def _config_heads(config) -> tuple[int | None, int | None]:
    n = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    kv = getattr(config, "num_key_value_heads", None) or n
    return n, kv


def resolve_plan(model: nn.Module, plan: dict[str, str] | None = None) -> tuple[dict[str, str], str]:
    """The plan as ``{module-name pattern: style}`` over ``model.named_modules()``, and its source."""
    if plan:
        return dict(plan), "user plan"
    base = getattr(model, "base_model", model)
    prefix = "" if base is model else f"{model.base_model_prefix}."
    head_plan = dict(getattr(type(model), "_tp_plan", None) or {})
    base_plan = getattr(model.config, "base_model_tp_plan", None) or {}
    if base_plan:
        return {**{prefix + k: v for k, v in base_plan.items()}, **head_plan}, "model tp plan"
    if getattr(model.config, "model_type", None) == "gpt2":
        if getattr(model.config, "add_cross_attention", False):
            raise NotImplementedError("tensor parallel GPT-2 with cross-attention is not supported")
        out = {prefix + k: v for k, v in GPT2_PLAN.items()}
        if model.get_output_embeddings() is not None:
            out["lm_head"] = "colwise_gather_output"
        return out, "built-in gpt2 plan"
    out = {}
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(mod, nn.Linear) and re.search(r"\.\d+\.", name):
            if leaf in _FALLBACK_COL:
                out[name] = "colwise"
            elif leaf in _FALLBACK_ROW:
                out[name] = "rowwise"
    head = model.get_output_embeddings()
    for name, mod in model.named_modules():
        if head is not None and mod is head:
            out[name] = "colwise_gather_output"
    return out, "name fallback"


def _matcher(plan: dict[str, str]):
    compiled = [(re.compile("^" + re.escape(p).replace(r"\*", r"\d+") + "$"), s)
                for p, s in plan.items()]

    def style_of(name: str) -> str | None:
        for rx, style in compiled:
            if rx.match(name):
                return style
        return None

    return style_of


def _set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, new)


def _check_heads(model: nn.Module, t: int, styles: set[str]) -> None:
    if not styles & {"colwise", "colwise_qkv", "packed_colwise"}:
        return
    n, kv = _config_heads(model.config)
    if n is not None and (n % t or kv % t):
        raise ValueError(f"tensor parallel size {t} must divide the attention heads: "
                         f"num_attention_heads={n}, "
                         f"num_key_value_heads={kv} ({n} % {t} = {n % t}, {kv} % {t} = {kv % t}); "
                         f"choose a degree that divides both")


@dataclass
class _Replaced:
    """What one pass of :func:`apply_tensor_parallel` built, read by the steps after it."""

    vocab_emb: VocabParallelEmbedding | None = None
    head_name: str | None = None
    new_head: nn.Module | None = None
    parents: set[str] = field(default_factory=set)  # modules whose q/k/v were split (heads patched)
    shared: dict[str, SharedCopy] = field(default_factory=dict)


def apply_tensor_parallel(model: nn.Module, tp: Comm, plan: dict[str, str] | None = None,
                          parallel_loss: bool = True, sync_sampling: bool = True) -> TPReport:
    """Shard ``model`` (an HF causal LM) over the TP group ``tp`` in place; see the module docstring.

    ``parallel_loss``: when ``labels`` are passed, the head keeps its vocabulary shard and the loss is
    the vocab-parallel cross-entropy (``out.logits`` is then this rank's vocabulary slice).
    ``sync_sampling``: ``generate()`` draws from a seed shared by the TP ranks, so sampled tokens agree.
    """
    if tp_state_of(model) is not None:
        raise RuntimeError("apply_tensor_parallel was already applied to this model")
    t = tp.size
    rules, source = resolve_plan(model, plan)
    report = TPReport(plan_source=source, tp_size=t)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and emb is not None and head.weight is emb.weight
    report.tied = tied
    todo = _styled_modules(model, _matcher(rules), emb)
    _check_heads(model, t, {s for _, _, s in todo})
    done = _Replaced()
    for name, mod, style in todo:
        report.modules[name] = style
        _replace(model, name, mod, style, tp, tied and mod is head, report, done)
    if tied and head is not None:
        if done.vocab_emb is None:
            raise RuntimeError("tied head without a vocab-parallel input embedding")
        done.head_name = done.head_name or next(n for n, m in model.named_modules() if m is head)
        done.new_head = vocab_head_sharing(done.vocab_emb, head, tp)
        _set_module(model, done.head_name, done.new_head)
    for pname in done.parents:
        _patch_heads(model.get_submodule(pname) if pname else model, t, source)
    _record_specs(model, report)
    model.__dict__[_TP_SLOT] = TPState(report, tp)
    if isinstance(done.new_head, ColumnParallelLinear) and parallel_loss and t > 1:
        _wrap_forward_with_parallel_loss(model, done.new_head, tp)
    if sync_sampling and t > 1 and hasattr(model, "generate"):
        _wrap_generate(model, tp)
    return report


def _styled_modules(model: nn.Module, style_of, emb: nn.Module | None) -> list[tuple[str, nn.Module, str]]:
    """``(name, module, style)`` for every module the plan names (the input embedding always row-wise)."""
    todo = []
    for name, mod in list(model.named_modules()):
        style = style_of(name) if name else None
        if mod is emb:
            style = "embedding_rowwise"
        if style is None:
            continue
        if style not in SUPPORTED:
            raise NotImplementedError(f"tensor parallel style {style!r} (module {name}) is not supported; "
                                      f"supported: {', '.join(SUPPORTED)}")
        todo.append((name, mod, style))
    return todo


def _replace(model: nn.Module, name: str, mod: nn.Module, style: str, tp: Comm, tied_head: bool,
             report: TPReport, done: _Replaced) -> None:
    """Swap one module for its parallel layer as ``style`` says (a tied head waits for the embedding)."""
    if style == "embedding_rowwise":
        if not isinstance(mod, nn.Embedding):
            raise NotImplementedError(f"{name}: embedding_rowwise on {type(mod).__name__}")
        done.vocab_emb = VocabParallelEmbedding.from_module(mod, tp)
        _set_module(model, name, done.vocab_emb)
    elif style == "replicated_with_grad_allreduce":
        for pn, p in mod.named_parameters():
            p.register_hook(functools.partial(_all_reduced, tp=tp))
            report.partial_grad.append(f"{name}.{pn}")
    elif style == "rowwise":
        if isinstance(mod, nn.Embedding):  # older plans call vocab-parallel embeddings "rowwise"
            done.vocab_emb = VocabParallelEmbedding.from_module(mod, tp)
            _set_module(model, name, done.vocab_emb)
        else:
            _set_module(model, name, RowParallelLinear.from_module(mod, tp, name=name))
    elif style == "colwise_gather_output":
        done.head_name = name
        if not tied_head:
            done.new_head = ColumnParallelLinear.from_module(mod, tp, gather_output=True, pad=True, name=name)
            _set_module(model, name, done.new_head)
    else:
        layer = ColumnParallelLinear.from_module(mod, tp, parts=_PARTS.get(style, 1), name=name)
        parent = name.rpartition(".")[0]
        layer.shared_copy = done.shared.setdefault(parent, SharedCopy())  # q/k/v share one f
        layer.shared_copy.members += 1
        _set_module(model, name, layer)
        done.parents.add(parent)


def _record_specs(model: nn.Module, report: TPReport) -> None:
    """Which parameters are TP slices (their ``ShardSpec``) and which are replicated (spec None)."""
    for n, p in model.named_parameters():
        spec = getattr(p, "_tp_spec", None)
        if spec is not None:
            report.sharded[n] = spec
        else:
            p._tp_spec = None  # type: ignore[attr-defined]
            report.replicated.append(n)


def _all_reduced(g: torch.Tensor, tp: Comm) -> torch.Tensor:
    g = g.contiguous().clone()
    tp.all_reduce(g)
    return g


def _patch_heads(module: nn.Module, t: int, source: str) -> None:
    """Per-rank head counts on the attention module, so HF's attention code runs unchanged."""
    for attr in _HEAD_ATTRS:
        v = getattr(module, attr, None)
        if isinstance(v, int) and not isinstance(v, bool):
            setattr(module, attr, v // t)
    if source == "built-in gpt2 plan" and hasattr(module, "split_size"):
        module.split_size //= t  # c_attn output is now q|k|v of h/t each


def _wrap_forward_with_parallel_loss(model: nn.Module, head: ColumnParallelLinear, tp: Comm) -> None:
    inner = model.forward

    @functools.wraps(inner)
    def forward(*args, labels: torch.Tensor | None = None, **kwargs):
        if labels is None:
            return inner(*args, **kwargs)
        head.gather_output = False
        try:
            out = inner(*args, **kwargs)
        finally:
            head.gather_output = True
        logits = out["logits"] if isinstance(out, dict) else out[0]
        loss = causal_lm_loss(logits, labels, tp, head.out_features,
                              num_items_in_batch=kwargs.get("num_items_in_batch"),
                              shift_labels=kwargs.get("shift_labels"))
        if isinstance(out, dict):
            return type(out)(**{"loss": loss, **{k: v for k, v in out.items() if k != "loss"}})
        return (loss, *out)

    model.forward = forward


def _wrap_generate(model: nn.Module, tp: Comm) -> None:
    inner = model.generate

    @functools.wraps(inner)
    def generate(*args, **kwargs):
        # TP rank 0's draw (the CPU generator, as before) is used; broadcast on the collectives' device
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64).to(compute_device())
        tp.broadcast(seed, src=0)
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(int(seed))
            return inner(*args, **kwargs)

    model.generate = generate


# -- whole tensors back from shards --------------------------------------------------------------
def is_tp_sharded(p: torch.Tensor) -> bool:
    """Whether ``p`` is a tensor-parallel slice (what the ZeRO builder is told, see zero/builder.py)."""
    return getattr(p, "_tp_spec", None) is not None


def gather_full(local: torch.Tensor, spec: ShardSpec | None, tp: Comm) -> torch.Tensor:
    """All TP ranks' local tensors -> the full HF tensor (padding dropped), on every TP rank."""
    if spec is None or tp.size == 1:
        return local
    local = local.contiguous()
    buf = local.new_empty((tp.size, local.numel()))
    buf[tp.rank].copy_(local.view(-1))
    tp.all_gather(buf.view(-1))
    shape = list(local.shape)
    shape[spec.dim] = spec.full
    full = local.new_empty(shape)
    for r in range(tp.size):
        shard = buf[r].view(local.shape)
        for a, b, d in spec.for_rank(r).pieces():
            full.narrow(spec.dim, a, b - a).copy_(shard.narrow(spec.dim, d, b - a))
    return full


def gather_param(p: torch.Tensor, tp: Comm) -> torch.Tensor:
    """The full (unpadded, HF-layout) tensor of a TP-sharded parameter; replicated ones as they are."""
    spec = getattr(p, "_tp_spec", None)
    if spec is None or tp.size == 1:
        return p.detach().clone()
    return gather_full(p.detach(), spec, tp)


def gather_state_dict(model: nn.Module, tp: Comm | None = None) -> dict[str, torch.Tensor]:
    """Full parameters by name (every TP rank gets them); tied parameters appear once."""
    tp = tp or tp_state_of(model).comm
    return {n: gather_param(p, tp) for n, p in model.named_parameters()}


def tp_grad_norm(params, tp: Comm, norm_type: float = 2.0) -> torch.Tensor:
    """Global 2-norm of grads over the TP group: sharded grads summed over ranks, replicated once."""
    from shardwise.optim.grad_norm import global_grad_norm

    if norm_type != 2.0:
        raise NotImplementedError("only the 2-norm")
    return global_grad_norm(((p.grad, is_tp_sharded(p)) for p in params if p.grad is not None), tp=tp)
