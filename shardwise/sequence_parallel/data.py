"""The data side of sequence parallelism: split each batch's sequence over the SP ranks.

Every SP rank reads the same samples (a data-parallel sampler over world / SP replicas) and keeps
its contiguous shard of the sequence. Three things make the shards add up to the whole:
- ``position_ids`` are the global positions, so rotary embeddings are right on every shard;
- ``labels`` become ``shift_labels`` *before* the split (the target of token t is token t + 1, the
  last one -100), so the target of each shard's last token, which lives on the next rank, is kept;
- the sequence is padded to a multiple of the SP degree with ``-100`` labels (all-to-alls of equal
  shards), and right padding given by ``attention_mask`` is removed the same way: under a causal
  mask a real token never attends to a later pad, so dropping the mask changes no real token.
Any other mask (left padding, holes, packed sequences) is refused: Ulysses attention applies one
causal mask over the whole sequence.

Layouts (``sp.layout``): ``"contiguous"`` (Ulysses: rank r holds tokens ``[r·s/N, (r+1)·s/N)``, so
the all-to-all's concatenation in rank order is the sequence) and ``"zigzag"`` (ring attention's
load balance under a causal mask: the sequence in ``2N`` chunks, rank r holding chunks r and
``2N-1-r``, padded to a multiple of ``2N``). The loss is a sum over tokens, so it is the same in
either layout; ``position_ids`` are the global ones, gathered with the tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from shardwise.comm import make_comm
from shardwise.sequence_parallel.group import SequenceParallel

IGNORE = -100
KNOWN = ("input_ids", "attention_mask", "labels", "shift_labels", "position_ids")
LAYOUTS = ("contiguous", "zigzag")


def chunks_per_shard(layout: str) -> int:
    """How many contiguous pieces of the sequence one rank's shard is made of."""
    if layout not in LAYOUTS:
        raise ValueError(f"sequence parallelism: unknown shard layout {layout!r} (one of {LAYOUTS})")
    return 2 if layout == "zigzag" else 1


def shard_indices(rank: int, size: int, length: int, layout: str) -> torch.Tensor:
    """The indices, in the padded whole sequence, of the ``length`` tokens rank ``rank`` holds."""
    count = chunks_per_shard(layout)
    chunk = length // count
    if count == 1:
        return torch.arange(rank * length, (rank + 1) * length)
    first, second = rank * chunk, (2 * size - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def _right_padded(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` as a bool tensor after checking every row is ones then zeros; one-line error otherwise."""
    m = mask.bool()
    if (m[:, 1:] & ~m[:, :-1]).any():
        raise ValueError("sequence parallelism: attention_mask has a 0 before a 1 (left padding, holes or "
                         "packing); only right padding can be split, pad on the right")
    return m


def _shift(batch: dict[str, Any], ids: torch.Tensor) -> torch.Tensor | None:
    if "shift_labels" in batch:
        if "labels" in batch:
            raise ValueError("sequence parallelism: the batch has both labels and shift_labels; give one")
        return batch["shift_labels"].clone()
    if "labels" not in batch:
        return None
    labels = batch["labels"]
    pad = torch.full_like(labels[:, :1], IGNORE)
    return torch.cat([labels[:, 1:], pad], dim=1)


def _pad_to(t: torch.Tensor, length: int, value: int) -> torch.Tensor:
    extra = length - t.shape[1]
    if extra == 0:
        return t
    return torch.cat([t, torch.full((t.shape[0], extra), value, dtype=t.dtype, device=t.device)], dim=1)


def split_batch(batch: dict[str, Any], sp: SequenceParallel, pad_token_id: int = 0) -> dict[str, Any]:
    """This rank's shard of ``batch`` (a dict of ``[batch, seq]`` tensors, the same on every SP rank),
    in ``sp.layout`` (contiguous for Ulysses, zigzag for ring attention).

    Returns ``input_ids``, ``position_ids`` and ``shift_labels`` (when the batch has ``labels`` or
    ``shift_labels``), all tensors, as DeepSpeed's adapter yields them (a loop may ``.to(device)``
    every value); the batch's own non-tensor entries pass through. The KV cache is turned off by the
    SP attention's forward hook (``attention._without_cache``), not by a key of the batch.
    """
    ids = batch.get("input_ids")
    if ids is None or ids.dim() != 2:
        raise ValueError("sequence parallelism: split_batch needs input_ids shaped [batch, seq]")
    for k, v in batch.items():
        if k not in KNOWN and isinstance(v, torch.Tensor):
            raise ValueError(f"sequence parallelism: split_batch does not know how to split batch[{k!r}]")
    seq = ids.shape[1]
    shift = _shift(batch, ids)
    if batch.get("attention_mask") is not None:
        real = _right_padded(batch["attention_mask"])
        if shift is not None:
            shift = shift.masked_fill(~real, IGNORE)
    pos = batch.get("position_ids")
    if pos is None:
        pos = torch.arange(seq, device=ids.device)
    pos = pos.expand_as(ids)
    n, r = sp.size, sp.rank
    layout = getattr(sp, "layout", "contiguous")  # a SequenceParallel has one; a bare (size, rank) is contiguous
    unit = n * chunks_per_shard(layout)
    total = -(-seq // unit) * unit
    length = total // n
    extra_pos = torch.arange(seq, total, device=ids.device).expand(ids.shape[0], -1)
    pos = torch.cat([pos, extra_pos.to(pos.dtype)], dim=1)
    out: dict[str, Any] = {k: v for k, v in batch.items() if not isinstance(v, torch.Tensor)}
    mine = shard_indices(r, n, length, layout).to(ids.device)  # index copies: HF's loss .view()s the labels
    out["input_ids"] = _pad_to(ids, total, pad_token_id)[:, mine].contiguous()
    out["position_ids"] = pos[:, mine].contiguous()
    if shift is not None:
        out["shift_labels"] = _pad_to(shift, total, IGNORE)[:, mine].contiguous()
    return out


class SequenceSplitLoader:
    """Wrap a data loader: every batch it yields comes out as this rank's sequence shard."""

    def __init__(self, loader: Iterable[dict[str, Any]], sp: SequenceParallel, pad_token_id: int = 0):
        self.loader, self.sp, self.pad_token_id = loader, sp, pad_token_id

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.loader:
            yield split_batch(batch, self.sp, self.pad_token_id)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]


class GatheredSplitLoader:
    """Each step gathers one batch from every SP rank's loader and yields them in turn, each as this
    rank's sequence shard (``split_batch``), so every rank's batches are trained, as DeepSpeed's
    ``UlyssesSPDataLoaderAdapter`` does. With ``mask_key``, a shard of a padded batch also carries
    ``token_mask`` under that key (for the whole sequence's MoE aux loss); ``device``: where the
    shard's tensors go (None: left where ``split_batch`` made them)."""

    def __init__(self, loader: Iterable[dict[str, Any]], sp: SequenceParallel, device: Any = None,
                 mask_key: str | None = None):
        self.dl, self.sp, self.device, self.mask_key = loader, sp, device, mask_key
        self.iter = iter(loader)
        self.pending: deque[dict] = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp.size  # type: ignore[arg-type]

    def __iter__(self) -> GatheredSplitLoader:
        return self

    def __next__(self) -> dict:
        if not self.pending:
            self._refill()
        return self.pending.popleft()

    def _refill(self) -> None:
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)
            raise
        local = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        everyone: list[Any] = [None] * self.sp.size
        make_comm(self.sp.comm.group).all_gather_object(everyone, local)  # guarded; not ZeRO's byte counts
        for b in everyone:
            shard = split_batch(b, self.sp)
            mask = token_mask(b, self.sp) if self.mask_key is not None else None
            if mask is not None:
                shard[self.mask_key] = mask
            self.pending.append({k: v.to(self.device) if isinstance(v, torch.Tensor) and self.device is not None
                                 else v for k, v in shard.items()})


def token_mask(batch: dict[str, Any], sp: SequenceParallel) -> torch.Tensor | None:
    """The real tokens of ``batch`` (unsplit, as given to ``split_batch``) laid out as the SP ranks'
    shards concatenated (in ``sp.layout``: ring attention's zigzag shards are not in sequence order):
    ``[batch, seq rounded up as split_batch pads it]``, 1 for a token the no-SP run
    sees unmasked, 0 for right padding and for the padding ``split_batch`` appends; None when every
    position is a real token (no ``attention_mask`` and ``seq`` a multiple of ``sp``).

    What the router's aux loss over the whole sequence needs: the shards carry no attention mask
    (Ulysses attention needs none for right padding), but the no-SP run's aux loss leaves its
    masked tokens out."""
    ids = batch.get("input_ids")
    if ids is None or ids.dim() != 2:
        raise ValueError("sequence parallelism: token_mask needs input_ids shaped [batch, seq]")
    seq, mask = ids.shape[1], batch.get("attention_mask")
    layout = getattr(sp, "layout", "contiguous")
    total = -(-seq // (sp.size * chunks_per_shard(layout))) * sp.size * chunks_per_shard(layout)
    if mask is None and total == seq:
        return None
    real = _pad_to(torch.ones_like(ids, dtype=torch.long) if mask is None else _right_padded(mask).long(), total, 0)
    if layout == "contiguous":
        return real
    # zigzag: the shards' tokens are not in sequence order; lay the mask out as they are concatenated
    order = torch.cat([shard_indices(r, sp.size, total // sp.size, layout) for r in range(sp.size)])
    return real[:, order.to(real.device)]
