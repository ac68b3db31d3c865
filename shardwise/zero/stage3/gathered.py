"""Full parameters on demand: ``GatheredParameters`` and the stage-3 state_dict guard."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from shardwise.comm import Comm, compute_device
from shardwise.sharded_init.context import defer_again, materialize_for_gather
from shardwise.zero.flat_group import ShardedGroup, owner_of


def _groups_of(params: Iterable[torch.Tensor]) -> list[ShardedGroup]:
    seen: dict[int, ShardedGroup] = {}
    for p in params:
        g = owner_of(p)
        if g is not None:
            seen.setdefault(id(g), g)
    return list(seen.values())


class GatheredParameters:
    """Inside the block the given parameters are whole on every rank; re-sharded on exit.

    With ``modifier_rank`` set, that rank's edits made inside the block are broadcast to
    every rank and written into the shards (and fp32 masters) on exit. All ranks of the
    data-parallel group must enter the block together (it is a collective).

    On a model built under ``zero.Init`` and not yet given to ``initialize`` (parameters on
    meta), the block gives the parameters their real values (from the checkpoint, or the
    model's init); with ``modifier_rank`` they then stay real, with that rank's edits, and
    ``initialize`` shards them as they are; without it they go back to meta.

    ``None`` (or a list holding ``None`` entries, such as a missing bias) is accepted and skipped.
    """

    def __init__(self, params: torch.Tensor | Iterable[torch.Tensor | None] | None, modifier_rank: int | None = None,
                 enabled: bool = True, fwd_module: nn.Module | None = None):  # noqa: ARG002 (DeepSpeed's)
        if isinstance(params, torch.Tensor):
            params = [params]
        # None entries are skipped, as DeepSpeed does: transformers' resize_token_embeddings passes
        # [old.weight, old.bias, new.weight, new.bias] with the biases None
        params = [p for p in params if p is not None] if enabled and params is not None else []
        self.params = list({id(p): p for p in params}.values())
        self.groups = _groups_of(params)
        # zero.Init before initialize: parameters still on meta get real values in the block
        self.deferred = [p for p in {id(p): p for p in params}.values() if p.is_meta]
        self.modifier_rank = modifier_rank
        self._was_gathered: list[bool] = []
        self._versions: list[tuple[torch.Tensor, int, int]] = []

    def __enter__(self) -> GatheredParameters:
        self._was_gathered = [g.is_gathered for g in self.groups]
        for g in self.groups:
            g.gather(exact=True)  # also finishes a pending stage 1-2 all-gather; never quantized (qwZ)
        if self.deferred:
            materialize_for_gather(self.deferred, Comm())
        if self.modifier_rank is None:  # read-only block: an in-place edit would be lost, so detect it
            self._versions = [(p, p._version, p.data_ptr()) for p in self.params]
        return self

    def __exit__(self, *exc) -> None:
        edited = exc[0] is None and self._edited_read_only()
        self._exit(*exc)
        if edited:
            raise RuntimeError(
                "GatheredParameters(modifier_rank=None): detected in-place modification of a parameter "
                "inside the block; such an edit is not kept consistently on every rank (discarded on exit at "
                "stage 3, overwritten by the next step below it). Pass modifier_rank=<rank> to keep that "
                "rank's edits on every rank")

    def _edited_read_only(self) -> bool:
        """True on every rank when an in-place edit on any rank would be lost (a collective, as the
        block is). An edit that leaves every value equal to what persists (loading the weights the
        model already has, a no-op clamp) loses nothing and is allowed, as in DeepSpeed."""
        if self.modifier_rank is not None or not self._versions:
            return False
        touched = {id(p) for p, v, ptr in self._versions if p._version != v or p.data_ptr() != ptr}
        self._versions = []
        comm = self.groups[0].comm if self.groups else Comm()
        if not self._any_rank(comm, bool(touched)):
            return False
        ungrouped = any(id(p) in touched and owner_of(p) is None for p in self.params)
        lost = [_differs_from_persisted(g) for g in self.groups]  # every group on every rank: collectives
        return self._any_rank(comm, ungrouped or any(lost))

    @staticmethod
    def _any_rank(comm: Comm, mine: bool) -> bool:
        if comm.size == 1:
            return mine
        flag = torch.tensor([float(mine)], device=compute_device())
        comm.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def _exit(self, *exc) -> None:
        if self.modifier_rank is not None and exc[0] is None:
            for g in self.groups:
                g.adopt_full(src=self.modifier_rank)
        if self.deferred:
            if self.modifier_rank is not None and exc[0] is None:
                comm = Comm()
                with torch.no_grad():
                    for p in self.deferred:  # they stay real and whole until initialize shards them
                        comm.broadcast(p.data, src=self.modifier_rank)
            else:
                defer_again(self.deferred)  # read-only use: edits are discarded, memory freed
        for g, was in zip(self.groups, self._was_gathered, strict=True):
            if not was:
                g.release(detach_storage=True)  # tensors kept from the block stay valid


def _differs_from_persisted(g) -> bool:
    """Whether ``g``'s gathered buffer differs from what survives the block. Sharded copies (stage-3
    shards, released on exit; stage 1-2 masters, which overwrite the parameters at the next step)
    are all-gathered into a scratch buffer; a replicated copy (stage 0, frozen groups) is rank 0's,
    broadcast, so ranks that edited differently count too. Collective over ``g.comm``; a
    file-backed group (nothing resident to compare with) counts as differing."""
    if g.store.rereads:
        return True
    sharded = g.param_shard if g.policy.shard_params else g.master if g.policy.shard_optimizer else None
    scratch = torch.zeros(g.padded_numel, dtype=g.dtype, device=g.flat_param.device)
    with torch.no_grad():
        if sharded is not None:
            scratch.narrow(0, g.own_start, g.own_numel).copy_(sharded)
            g.comm.all_gather(scratch)
        else:
            scratch.copy_(g.master if g.master is not None else g.flat_param)
            g.comm.broadcast(scratch, src=0)
    return not torch.equal(scratch[:g.numel], g.flat_param[:g.numel])


def guard_state_dict(model: nn.Module) -> None:
    """At stage 3 a state_dict of released parameters would hold placeholders: refuse it clearly."""

    def hook(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        released = [n for n, p in module.named_parameters()
                    if owner_of(p) is not None and not owner_of(p).is_gathered]
        if released:
            raise RuntimeError(
                f"state_dict() at ZeRO stage 3: {len(released)} parameters (e.g. {released[0]!r}) are "
                "sharded across ranks right now. Call it inside "
                "`with shardwise.zero.GatheredParameters(model.parameters()):` on every rank, or use "
                "engine.save_16bit_model(dir) / engine.save_checkpoint(dir)")

    model.register_state_dict_pre_hook(hook)
