"""An MoE model's router load-balancing (aux) loss under SP: the whole sequence's, on every SP rank.

HF MoE models add ``router_aux_loss_coef * E * sum_e f_e * P_e`` to their loss, where ``f_e`` (the
fraction of routed slots going to expert ``e``) and ``P_e`` (its mean router probability) are means
over every real token of the batch: not linear in the tokens, so the shards' own aux losses do not
add up to it (their mean is another objective). Every SP rank gathers every layer's router logits
(``[tokens of its shard, experts]`` per layer: small) over the SP group and calls the model's own
``load_balancing_loss_func`` on the whole sequence, with the real-token mask laid out like the
gathered logits (``data.token_mask``). The gather's backward gives each rank the sum over the ranks
of its slice's gradient (``GatherShards``): ``sp`` times its share, the SP loss's convention, which
the engine's average over the SP x DP ranks brings back to the whole term's gradient.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from shardwise.sequence_parallel.data import token_mask
from shardwise.sequence_parallel.exchange import GatherShards
from shardwise.sequence_parallel.group import SequenceParallel, current
from shardwise.sequence_parallel.loss import loss_of_shard_means

_ATTRS = ("router_aux_loss_coef", "num_experts", "num_experts_per_tok")  # what the models' forward reads


def _aux_function(lm: object) -> Any:
    return getattr(sys.modules.get(type(lm).__module__), "load_balancing_loss_func", None)


def moe_causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The HF MoE causal LM inside ``model`` (an engine, a DDP or PEFT wrapper): the object whose
    forward adds the aux loss, holding ``router_aux_loss_coef``, ``num_experts``, ``num_experts_per_tok``,
    whose modeling module has ``load_balancing_loss_func`` (a wrapper may forward the attributes)."""
    seen, holder = model, None
    for _ in range(8):
        if all(hasattr(seen, a) for a in _ATTRS):
            holder = seen
            if _aux_function(seen) is not None:
                return seen
        inner = next((getattr(seen, a) for a in ("module", "base_model", "model") if hasattr(seen, a)), None)
        if not isinstance(inner, torch.nn.Module) or inner is seen:
            break
        seen = inner
    if holder is None:
        raise ValueError(f"{type(model).__name__} returned an aux_loss but holds no MoE causal LM with "
                         f"{', '.join(_ATTRS)} to compute it over the whole sequence")
    raise ValueError(f"{type(holder).__name__} returned an aux_loss but its modeling module has no "
                     "load_balancing_loss_func; sequence parallelism cannot compute it over the whole sequence")


def whole_sequence_aux(router_logits: tuple[torch.Tensor, ...], model: torch.nn.Module,
                       mask: torch.Tensor | None, sp: SequenceParallel) -> torch.Tensor:
    """The model's aux loss (without its coefficient) over the whole sequence, the same on every SP
    rank. ``router_logits``: this shard's, ``[batch * shard length, experts]`` per layer; ``mask``:
    ``token_mask``'s ``[batch, sp * shard length]`` (None: every gathered token counts)."""
    lm = moe_causal_lm(model)
    fn = _aux_function(lm)
    layers = torch.stack(tuple(router_logits))  # [layers, batch * s, experts]: one gather for all layers
    gathered = GatherShards.apply(layers, sp.comm)  # [sp, layers, batch * s, experts]
    n_layers, experts = layers.shape[0], layers.shape[-1]
    if mask is not None:  # rows batch-major, then the ranks' shards in order: the mask's [batch, sp * s]
        gathered = gathered.view(sp.size, n_layers, mask.shape[0], -1, experts).permute(1, 2, 0, 3, 4)
    else:  # no mask: the means do not depend on the order of the tokens
        gathered = gathered.transpose(0, 1)
    whole = gathered.reshape(n_layers, -1, experts)
    return fn(tuple(whole.unbind(0)), lm.num_experts, lm.num_experts_per_tok, mask)


def router_aux_loss(output: Any, model: torch.nn.Module, batch: dict[str, Any],
                    sp: SequenceParallel | None = None) -> torch.Tensor | float:
    """The router's aux term of a sequence-split batch, ``router_aux_loss_coef *`` the aux loss over
    the whole sequence (what the no-SP run adds), the same on every SP rank: add it to
    ``sequence_parallel_loss``. ``output``: the model's output on this rank's shard; ``batch``: the
    unsplit batch given to ``split_batch`` (its ``input_ids`` and ``attention_mask``); ``sp``: the
    SP group (default ``current()``). 0.0 when the output has no aux loss (a dense model, or
    ``output_router_logits`` off).

    Why here: the shard goes in without labels, so the model adds no aux loss, and the one it
    reports (``output.aux_loss``) is its shard's, which is not the whole sequence's."""
    if getattr(output, "aux_loss", None) is None:
        return 0.0
    sp = current() if sp is None else sp
    return _aux_term(output, model, moe_causal_lm(model), token_mask(batch, sp), sp)


def _aux_term(output: Any, model: torch.nn.Module, lm: torch.nn.Module, mask: torch.Tensor | None,
              sp: SequenceParallel) -> torch.Tensor:
    """``router_aux_loss_coef *`` the aux loss over the whole sequence, from a shard's router logits."""
    logits = getattr(output, "router_logits", None)
    if not logits:
        raise ValueError(f"{type(model).__name__} returned an aux_loss without router_logits to compute it "
                         "over the whole sequence")
    return lm.router_aux_loss_coef * whole_sequence_aux(logits, lm, mask, sp)


def labelled_shard_loss(output: Any, model: torch.nn.Module, shift_labels: torch.Tensor,
                        mask: torch.Tensor | None, sp: SequenceParallel) -> torch.Tensor:
    """The no-SP objective from a shard's forward WITH labels (``output.loss``: the shard's token-mean
    cross entropy, plus its own aux term for an MoE model): the shards' means combined by
    ``loss_of_shard_means`` (transformers' value and gradient convention), the shard's aux term taken
    out and the whole sequence's (``mask``: the batch's real tokens as the shards lie) added once,
    ``router_aux_loss_coef`` times, as the model adds it without SP. What the HF Trainer's SP loss is."""
    shard_loss, aux = output.loss, getattr(output, "aux_loss", None)
    if aux is None:
        return loss_of_shard_means(shard_loss, shift_labels, sp)
    lm = moe_causal_lm(model)
    shard_loss = shard_loss - lm.router_aux_loss_coef * aux.to(shard_loss.device)
    return loss_of_shard_means(shard_loss, shift_labels, sp) + _aux_term(output, model, lm, mask, sp)


def serve_whole_sequence_aux(model: torch.nn.Module, mask_key: str) -> None:
    """Make an MoE ``model``'s reported ``aux_loss`` the whole sequence's while SP is on, for a forward
    without labels (a forward hook; a no-op for a dense model). Idempotent.

    Why: a loop that computes the LM loss itself from the logits and ``shift_labels`` (Accelerate's
    and DeepSpeed's documented SP loops) adds ``router_aux_loss_coef * outputs.aux_loss``, and the
    model's own is its shard's (whose mean over the SP ranks is another objective). ``mask_key``: the
    keyword under which the data adapter passes the batch's real tokens (``data.token_mask``). With
    labels (the HF Trainer) the model's loss holds its shard's term and the Trainer's SP loss
    replaces it, so the outputs are left as the model made them."""
    try:
        lm = moe_causal_lm(model)
    except ValueError:
        return  # a dense model (or one without the function): nothing to serve
    old = model.__dict__.pop("_shardwise_sp_aux", None)
    if old is not None:
        old.remove()

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:  # noqa: ARG001
        sp = current()
        if not sp.active() or getattr(output, "loss", None) is not None or getattr(output, "aux_loss", None) is None:
            return None
        output.aux_loss = whole_sequence_aux(output.router_logits, lm, kwargs.get(mask_key), sp)
        return output

    model.__dict__["_shardwise_sp_aux"] = model.register_forward_hook(hook, with_kwargs=True)
