"""Rank-side cases of tests/test_sp_memory.py: the bytes autograd keeps for backward, SP against none."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sp_cases import llama, sample_batch
from torch.autograd.graph import saved_tensors_hooks
from torch.multiprocessing.reductions import StorageWeakRef

from shardwise.sequence_parallel import SequenceParallel, register_attention, split_batch


def _live_saved_bytes(model: torch.nn.Module, loss_of: object) -> int:
    """Bytes of the storages autograd saved in one forward and still holds when it returns (parameters
    excluded, each storage once): what the activations weigh until backward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[StorageWeakRef, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params and s.nbytes():
            seen[s.data_ptr()] = (StorageWeakRef(s), max(s.nbytes(), seen.get(s.data_ptr(), (None, 0))[1]))
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        loss = loss_of()
    live = sum(n for ref, n in seen.values() if not ref.expired())
    loss.backward()  # it still trains
    return live


def _summed_loss(logits: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), shift_labels.flatten(), reduction="sum")


def saved_bytes_whole_and_split(impl: str, kv_heads: int, seq: int) -> dict:
    """Live saved bytes of one forward of the whole sequence (no SP) and of this rank's shard under SP."""
    sp = SequenceParallel.of_size(dist.get_world_size())
    model = llama(impl, kv_heads)
    batch = sample_batch(1, seq)
    ids = batch["input_ids"]
    shift = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    whole = _live_saved_bytes(model, lambda: _summed_loss(model(input_ids=ids).logits, shift))
    register_attention(model, sp)
    shard = split_batch(batch, sp)
    labels = shard.pop("shift_labels")
    shard.pop("labels", None)
    split = _live_saved_bytes(model, lambda: _summed_loss(model(**shard).logits, labels))
    return {"whole": whole, "split": split, "sp": sp.size}
