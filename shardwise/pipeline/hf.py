"""A Hugging Face causal LM cut into pipeline stages: ``initialize(model=hf_lm, config={"pipeline": {"stages": N}})``.

The model is read as the decoder families of transformers lay themselves out (Llama, Mistral, Qwen2,
...: ``model.embed_tokens``, ``model.layers``, ``model.norm``, ``model.rotary_emb``, ``lm_head``) and
becomes a :class:`PipelineModule` of ``2 + layers`` entries: the embedding first, one entry per decoder
layer, the final norm and the head last, cut uniformly by default (``pipeline.partition``). Each decoder
entry makes its own causal mask and rotary position embeddings from the hidden states it receives
(positions 0..S-1, no padding mask), so only hidden states cross between stages. With
``tie_word_embeddings`` the head is the embedding's weight used a second time (a ``TiedLayerSpec``): the
first and the last stage each hold a copy, trained as one.

The model is the one the script built. Built whole, each rank has it whole and its stage's engine holds
(and trains, shards, steps) only its stage's entries. Built under :func:`shardwise.pipeline.stage_init`
(``pipeline/stage_init.py``) every parameter is on the meta device and the split gives real values, the
whole build's bit for bit, to this stage's parameters alone: no rank materializes another stage's layers.
The items of ``train_batch``'s iterator are
``(input_ids, labels)`` pairs or dicts with ``input_ids`` (and ``labels``; default the inputs); the loss
is the model's own: the mean next-token cross-entropy over the labels that are not -100.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.engine.compat import UsageError
from shardwise.pipeline.module import PipelineModule
from shardwise.pipeline.spec import LayerSpec, TiedLayerSpec
from shardwise.pipeline.stage_init import materialize_stage


class Embedding(nn.Module):
    """The first entry: token ids to hidden states."""

    def __init__(self, embed: nn.Module):
        super().__init__()
        self.embed = embed

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)


class DecoderLayer(nn.Module):
    """One decoder layer, with the causal mask and rotary embeddings made from its input's length."""

    def __init__(self, layer: nn.Module, rotary: nn.Module, config: Any):
        super().__init__()
        self.layer, self.rotary = layer, rotary
        self.__dict__["config"] = config  # not a module: kept out of the stage's parameters

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None,
                                  position_ids=positions)
        out = self.layer(hidden, attention_mask=mask, position_ids=positions,
                         position_embeddings=self.rotary(hidden, position_ids=positions))
        return out[0] if isinstance(out, tuple) else out

    def decode(self, hidden: torch.Tensor, past: int, cache: Any) -> torch.Tensor:
        """The layer on ``hidden`` (positions ``past``..), keys and values kept in ``cache`` (``generate``),
        with the mask and rotary embeddings HF's model builds for the same step."""
        from transformers.masking_utils import create_causal_mask

        batch, length = hidden.shape[:2]
        positions = torch.arange(past, past + length, device=hidden.device).unsqueeze(0)
        seen = torch.ones(batch, past + length, dtype=torch.long, device=hidden.device)
        idx = getattr(getattr(self.layer, "self_attn", None), "layer_idx", None)
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=seen, cache=cache,
                                  position_ids=positions, layer_idx=idx)
        out = self.layer(hidden, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                         position_embeddings=self.rotary(hidden, position_ids=positions))
        return out[0] if isinstance(out, tuple) else out


class Head(nn.Module):
    """The last entry without tied embeddings: the final norm and the output projection."""

    def __init__(self, norm: nn.Module, head: nn.Module):
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(hidden))


class Norm(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden)


def tied_head(embedding: Embedding, hidden: torch.Tensor) -> torch.Tensor:
    """The head as the embedding's weight used a second time (``tie_word_embeddings``)."""
    return F.linear(hidden, embedding.embed.weight)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean next-token cross-entropy (in fp32) over the labels that are not -100."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1),
                           ignore_index=-100)


def lm_batch(item: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A data item as ``(input_ids, labels)``: a pair as it is, a dict by its keys."""
    if isinstance(item, dict):
        return item["input_ids"], item.get("labels", item["input_ids"])
    return item


def _parts(model: nn.Module) -> tuple[nn.Module, nn.Module, Any]:
    base = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if base is None or not all(hasattr(base, n) for n in needed) or not hasattr(model, "lm_head"):
        raise UsageError(f"pipeline.stages: {type(model).__name__} is not split automatically (served: decoder "
                         "models laid out as model.embed_tokens / model.layers / model.norm / model.rotary_emb / "
                         "lm_head, such as Llama, Mistral, Qwen2); build a PipelineModule of its layers")
    return base, model.lm_head, model.config


def split_causal_lm(model: nn.Module, stages: int, partition_method: str = "uniform",
                    virtual_stages: int = 1) -> PipelineModule:
    """``model`` as a :class:`PipelineModule` of ``stages`` stages (this rank keeps its stage's entries);
    ``virtual_stages > 1``: cut into ``stages x virtual_stages`` chunks for ``interleaved_1f1b`` (untied
    models: a tied head is a ``TiedLayerSpec``, which interleaving refuses in one line)."""
    base, head, config = _parts(model)
    tied = bool(getattr(config, "tie_word_embeddings", False)) and head.weight is base.embed_tokens.weight
    first = (TiedLayerSpec("embed", Embedding, base.embed_tokens, tied_weight_attr="embed.weight") if tied
             else LayerSpec(Embedding, base.embed_tokens))
    layers = [LayerSpec(DecoderLayer, layer, base.rotary_emb, config) for layer in base.layers]
    last = ([LayerSpec(Norm, base.norm), TiedLayerSpec("embed", Embedding, base.embed_tokens, forward_fn=tied_head,
                                                       tied_weight_attr="embed.weight")] if tied
            else [LayerSpec(Head, base.norm, head)])
    module = PipelineModule([first, *layers, *last], num_stages=stages, loss_fn=causal_lm_loss,
                            partition_method=partition_method, virtual_stages=virtual_stages)
    module.hf_config = config
    module.hf_generation_config = getattr(model, "generation_config", None)
    # this stage's parameter names -> the model's own (a tied head: the embedding's), for the HF export
    owner = {id(p): n for n, p in model.named_parameters()}
    module.hf_names = {n: owner[id(p)] for n, p in module.named_parameters(remove_duplicate=False) if id(p) in owner}
    # built under stage_init() (or zero.Init from a folder): only this stage's parameters become real
    module.materialized_bytes = materialize_stage(module, model)
    return module


def pipeline_virtual_stages(raw: dict) -> int:
    """``pipeline.virtual_stages`` of a config dict (shardwise's key: chunks per rank for
    ``pipeline.schedule: interleaved_1f1b``); 1 when absent."""
    v = (raw.get("pipeline") or {}).get("virtual_stages", 1)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise UsageError(f"pipeline.virtual_stages must be a positive integer, got {v!r}")
    return v


def pipeline_stages(raw: dict) -> int:
    """``pipeline.stages`` of a config dict: 1 when absent or ``"auto"`` (DeepSpeed's default)."""
    stages = (raw.get("pipeline") or {}).get("stages", 1)
    if stages in (None, "auto"):
        return 1
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise UsageError(f"pipeline.stages must be a positive integer or \"auto\", got {stages!r}")
    return stages
