"""Rank-side cases: every submodule of tiny HF models called on its own at ZeRO-3 (test_direct_calls.py).

The plain model runs one forward with hooks that record each module's first call (its arguments
and its output). The same model, sharded at stage 3 with every parameter released between uses
(``persistence_threshold=0``), then has each module called directly with those arguments. The
parameters a direct call gathers are the plain model's own values (rank 0's, broadcast) and the
call runs the same kernels on the same inputs, so every output must equal the plain one bit for
bit; after each call no sharded group may be left gathered.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves
from transformers import AutoModelForCausalLM, LlamaConfig, T5Config, T5ForConditionalGeneration

import shardwise
from shardwise.utils import safe_get_full_grad

VOCAB = 101


def build(kind: str) -> nn.Module:
    """Tiny models from configs, dropout off, eager attention: llama (untied), llama-tied, gpt2, t5."""
    torch.manual_seed(0)
    if kind in ("llama", "llama-tied"):
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                          tie_word_embeddings=kind == "llama-tied")
    elif kind == "gpt2":
        from transformers import GPT2Config

        cfg = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    elif kind == "t5":
        cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
                       num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    else:
        raise ValueError(kind)
    cfg._attn_implementation = "eager"
    if kind == "t5":
        return T5ForConditionalGeneration(cfg).eval()
    return AutoModelForCausalLM.from_config(cfg).eval()


def inputs(kind: str, batch: int = 2, seq: int = 9) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, VOCAB, (batch, seq), generator=g)
    if kind == "t5":
        return {"input_ids": ids, "decoder_input_ids": torch.randint(1, VOCAB, (batch, 5), generator=g),
                "use_cache": False}
    return {"input_ids": ids, "use_cache": False}


def record_calls(model: nn.Module, kw: dict) -> list[tuple[str, tuple, dict, Any]]:
    """(name, args, kwargs, output) of each module's first call in one forward of ``model``."""
    seen: dict[str, list] = {}
    handles = []
    for name, m in model.named_modules():
        def pre(mod, args, kwargs, name=name):
            if name not in seen:
                seen[name] = [copy.deepcopy(args), copy.deepcopy(kwargs), None]

        def post(mod, args, kwargs, out, name=name):
            if seen[name][2] is None:
                seen[name][2] = copy.deepcopy(out)

        handles += [m.register_forward_pre_hook(pre, with_kwargs=True),
                    m.register_forward_hook(post, with_kwargs=True)]
    with torch.no_grad():
        model(**kw)
    for h in handles:
        h.remove()
    return [(n, *seen[n]) for n in seen]


def _sharded(kind: str, front: str, **extra) -> tuple[nn.Module, Any, Any]:
    """The model at stage 3, every parameter sharded: (the module to call, its Sharding, the
    engine or the model: the caller keeps it alive)."""
    model = build(kind)
    if front == "shard":
        model = shardwise.shard(model, stage=3, persistence_threshold=0, bucket_size=4_000, **extra)
        return model, model.sharding, model
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 4_000,
            "allgather_bucket_size": 4_000, **extra}
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "train_batch_size": dist.get_world_size(), "zero_optimization": zero,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    return engine.module, engine.sharding, engine


def _gathered(sharding) -> list[str]:
    return [g.names[0] for gs in sharding.unit_groups for g in gs if g.policy.shard_params and g.is_gathered]


def _differences(got: Any, want: Any) -> str | None:
    a = [t for t in tree_leaves(got) if torch.is_tensor(t)]
    b = [t for t in tree_leaves(want) if torch.is_tensor(t)]
    if len(a) != len(b):
        return f"{len(a)} tensors, expected {len(b)}"
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x.shape != y.shape:
            return f"output tensor {i}: shape {tuple(x.shape)}, expected {tuple(y.shape)}"
        if not torch.equal(x, y):
            return f"output tensor {i}: max diff {(x.float() - y.float()).abs().max().item()}"
    return None


def every_submodule(kind: str, front: str = "shard", **extra) -> dict:
    """Call each module of the sharded model on its own with the plain model's recorded inputs; an
    embedding the forward never calls (T5's ``shared``, tied to the stacks' ``embed_tokens``: what
    ``get_input_embeddings()`` returns) is called with the input ids."""
    plain = build(kind)
    kw = inputs(kind)
    calls = record_calls(plain, kw)
    recorded = {c[0] for c in calls}
    with torch.no_grad():
        calls += [(n, (kw["input_ids"],), {}, m(kw["input_ids"])) for n, m in plain.named_modules()
                  if n not in recorded and isinstance(m, nn.Embedding)]
    model, sharding, _keep = _sharded(kind, front, **extra)
    wrong, leaked, called = {}, {}, []
    with torch.no_grad():
        for name, args, kwargs, want in calls:
            module = model.get_submodule(name)
            got = module(*copy.deepcopy(args), **copy.deepcopy(kwargs))
            called.append(name or "<root>")
            if (diff := _differences(got, want)) is not None:
                wrong[name] = diff
            if left := _gathered(sharding):
                leaked[name] = left
    never = [n for n, m in model.named_modules()
             if (n or "<root>") not in called and any(True for _ in m.parameters(recurse=False))]
    return {"called": called, "wrong": wrong, "leaked": leaked, "never_called_with_params": never}


# -- backward through directly called submodules ---------------------------------------------------
def _loss(kind: str, model: nn.Module, kw: dict) -> torch.Tensor:
    """A loss computed only through direct calls of submodules (as a fused loss or generate does)."""
    ids = kw["input_ids"]
    if kind == "t5":
        enc = model.get_encoder()(input_ids=ids).last_hidden_state
        dec = model.get_decoder()(input_ids=kw["decoder_input_ids"], encoder_hidden_states=enc).last_hidden_state
        return F.cross_entropy(model.lm_head(dec).flatten(0, 1), kw["decoder_input_ids"].flatten())
    body = model.transformer if kind == "gpt2" else model.model
    hidden = body(input_ids=ids).last_hidden_state
    logits = model.lm_head(hidden)  # a second entry: a head called apart from the body
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    layer = body.h[0] if kind == "gpt2" else body.layers[0]
    mlp_in = hidden.detach() * 0.5  # an inner module of a decoder layer, called on its own
    return loss + layer.mlp(mlp_in).pow(2).mean()


def reference_grads(kind: str) -> dict[str, torch.Tensor]:
    model = build(kind)
    _loss(kind, model, inputs(kind)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def backward_through_direct_calls(kind: str, front: str = "shard", **extra) -> dict:
    """Every rank computes the loss on the same batch, so the averaged gradient is (g + g) / 2 = g,
    exact in floating point: the gradients must equal the plain model's bit for bit."""
    model, sharding, _keep = _sharded(kind, front, **extra)
    loss = _loss(kind, model, inputs(kind))
    loss.backward()
    leaked = _gathered(sharding)
    grads = {}
    for n, p in model.named_parameters():
        g = safe_get_full_grad(p)
        if g is not None:
            grads[n] = g.clone()
    return {"loss": float(loss.detach()), "grads": grads, "leaked": leaked}


# -- what shardwise cannot see: a cached reference; and generate, which calls the encoder itself ----
def cached_reference(register: bool) -> dict:
    """A head whose forward uses the embedding's weight through a list (no attribute read), called
    on its own: refused by name; once registered as an external parameter, equal to plain."""
    from stage3_external_cases import HIDDEN
    from stage3_external_cases import build as build_plain

    h = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = build_plain("cached").head(h)
    model = build_plain("cached")
    if register:
        shardwise.zero.register_external_parameter(model.head, model.embed.weight)
    model = shardwise.shard(model, stage=3, persistence_threshold=0)
    try:
        with torch.no_grad():
            got = model.head(h)
    except shardwise.zero.ReleasedParameterError as e:
        return {"error": str(e), "leaked": _gathered(model.sharding)}
    return {"equal": torch.equal(got, want), "leaked": _gathered(model.sharding)}


def t5_generate(front: str = "shard") -> dict:
    """``generate`` calls ``get_encoder()(...)`` on its own, then the whole model per token."""
    ids = inputs("t5")["input_ids"]
    kw = {"max_new_tokens": 6, "do_sample": False, "num_beams": 1, "output_scores": True,
          "return_dict_in_generate": True, "suppress_tokens": [0, 1]}  # no pad / eos: 6 real tokens
    with torch.no_grad():
        want = build("t5").generate(input_ids=ids, **kw)
        model, sharding, _keep = _sharded("t5", front)
        got = model.generate(input_ids=ids, **kw)
    scores_equal = all(torch.equal(a, b) for a, b in zip(got.scores, want.scores, strict=True))
    finite = all(bool(torch.isfinite(s[:, 2:]).all()) for s in got.scores)
    return {"equal": torch.equal(got.sequences, want.sequences) and scores_equal, "finite": finite,
            "tokens": got.sequences.tolist(), "leaked": _gathered(sharding)}


def gathered_with_none() -> dict:
    """GatheredParameters skips None entries (transformers' resize passes absent biases), and an
    edit made on the modifier rank inside the block reaches every rank's shards."""
    model = shardwise.shard(build("llama"), stage=3, persistence_threshold=0)
    head = model.lm_head
    with shardwise.zero.GatheredParameters([head.weight, head.bias, None], modifier_rank=0):
        if dist.get_rank() == 0:
            with torch.no_grad():
                head.weight[0].fill_(3.0)
    with shardwise.zero.GatheredParameters(None):
        pass
    with shardwise.zero.GatheredParameters([head.weight]):
        row = head.weight[0].clone()
    return {"row_is_3": bool((row == 3.0).all()), "leaked": _gathered(model.sharding)}


class _ParamlessHead(nn.Module):
    """A head with no parameter of its own, using the embedding's weight through a list."""

    def __init__(self, embed: nn.Embedding):
        super().__init__()
        self._weight = [embed.weight]

    def forward(self, h):
        return F.linear(h, self._weight[0])


class _EmbedHead(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = _ParamlessHead(self.embed)

    def forward(self, x):
        return self.head(torch.tanh(self.embed(x)))


def paramless_registered_head() -> dict:
    """A module without parameters of its own, given one by register_external_parameter, called
    on its own: it gathers that parameter (it has no hooks of its own otherwise)."""
    h = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = _EmbedHead().head(h)
    model = _EmbedHead()
    shardwise.zero.register_external_parameter(model.head, model.embed.weight)
    model = shardwise.shard(model, stage=3, persistence_threshold=0)
    with torch.no_grad():
        got = model.head(h)
    return {"equal": torch.equal(got, want), "leaked": _gathered(model.sharding)}
