"""Synthetic DeepSpeed and DCP checkpoint folders for the foreign-reader hardening tests.

Each writer lays out a checkpoint exactly as DeepSpeed 0.19 / DCP (torch 2.13) do (the layout facts
of ``shardwise/checkpoint/deepspeed_format.py`` and ``dcp_format.py``), from parameters the test
chooses, and returns the tensors a correct reader must produce. Damage is described by plain
values (a tensor stored with another size / stride / offset, a tensor referenced several times,
a claimed size), so a hypothesis strategy can draw it. Needs neither DeepSpeed nor a process group.
"""

from __future__ import annotations

import collections
import math
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


def vm_hwm() -> int:
    """Peak resident memory of this process (bytes) since the last :func:`reset_hwm`."""
    return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def vm_rss() -> int:
    return int(re.search(r"VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def reset_hwm() -> bool:
    """Reset the peak to the current RSS (Linux ``clear_refs`` 5); False where that is not possible.

    Freed heap memory is first handed back to the system (``malloc_trim``), so memory a later
    allocation reuses counts as growth again instead of hiding in pages already resident."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class Strided:
    """Pickles as a tensor with any storage, offset, size and stride (torch's own rebuild function),
    including ones torch.save would never write (stride 0 over a huge size, past the storage end)."""

    def __init__(self, storage: torch.UntypedStorage, dtype: torch.dtype, offset: int, size: tuple, stride: tuple):
        self.storage, self.dtype, self.offset, self.size, self.stride = storage, dtype, offset, size, stride

    def __reduce__(self):
        typed = torch.storage.TypedStorage(wrap_storage=self.storage, dtype=self.dtype, _internal=True)
        return (torch._utils._rebuild_tensor_v2,
                (typed, self.offset, tuple(self.size), tuple(self.stride), False, collections.OrderedDict()))

    def value(self) -> torch.Tensor | None:
        """The tensor torch builds from this (None when it lies outside its storage)."""
        base = torch.empty(0, dtype=self.dtype).set_(self.storage)
        extent = 1 + sum((s - 1) * st for s, st in zip(self.size, self.stride, strict=True)) if all(self.size) else 0
        if self.offset + extent > base.numel() and extent:
            return None
        if math.prod(self.size) > base.numel():  # claims more elements than stored: the reader refuses it
            return None
        return base.as_strided(self.size, self.stride, self.offset)


def stored(t: torch.Tensor, view: tuple[int, int, int, int] | None) -> Any:
    """``t`` itself, or (``view`` = extra storage elements, offset, stride, size override or -1) a
    :class:`Strided` over a storage holding ``t``'s values at ``offset`` with ``stride``."""
    if view is None:
        return t.clone()
    extra, offset, stride, size = view
    n = t.numel() if size < 0 else size
    need = offset + (max(n - 1, 0) * stride + 1 if n else 0)
    length = max(need + extra, 0)
    storage = torch.zeros(min(length, offset + t.numel() * max(stride, 1) + 16), dtype=t.dtype)  # never huge
    flat = t.reshape(-1)
    if stride > 0:
        fill = min(n, flat.numel(), max((storage.numel() - offset + stride - 1) // stride, 0))
        storage[offset:offset + fill * stride:stride] = flat[:fill]
    elif storage.numel() > offset and flat.numel():
        storage[offset] = flat[0]
    return Strided(storage.untyped_storage(), t.dtype, offset, (n,), (stride,))


def value_of(x: Any) -> torch.Tensor | None:
    return x.value() if isinstance(x, Strided) else x


@dataclass
class DsDamage:
    """What to do to a DeepSpeed checkpoint (all None/0: an honest one)."""

    view: dict[tuple[int, int], tuple[int, int, int, int]] = field(default_factory=dict)  # (rank, group) -> view
    repeat: int = 0  # rank 0's flat group 0 listed this many extra times (shared references)
    shape: tuple[str, list[int]] | None = None  # a param_shapes entry replaced
    step: float | None = None  # Adam's step
    global_steps: Any = 2
    dag: int = 0  # client state: a chain of lists each holding the next twice (2**dag paths)
    nan_moment: bool = False  # one element of rank 0's exp_avg_sq is NaN
    alias: bool = False  # every group's flat and states are group 0's tensors (shared references)

    def honest(self) -> bool:
        damaged = self.view or self.repeat or self.shape or self.dag or self.nan_moment or self.alias
        return not damaged and self.step is None and self.global_steps == 2


def _flat_parts(shapes: list[dict[str, list[int]]], world: int, stage: int, values: dict[str, torch.Tensor]
                ) -> list[list[torch.Tensor]]:
    """Per rank, per group, that rank's flat fp32 slice (DeepSpeed's layout for the stage)."""
    out = [[] for _ in range(world)]
    for group in shapes:
        if stage < 3:
            flat = torch.cat([values[n].reshape(-1) for n in group])
            pad = (-flat.numel()) % (2 * world)
            flat = torch.cat([flat, torch.zeros(pad)])
            for r, piece in enumerate(flat.chunk(world)):
                out[r].append(piece.clone())
        else:
            per_rank = [[] for _ in range(world)]
            for n in group:
                v = values[n].reshape(-1)
                part = math.ceil(v.numel() / world)
                v = torch.cat([v, torch.zeros(part * world - v.numel())])
                for r in range(world):
                    per_rank[r].append(v[r * part:(r + 1) * part])
            for r in range(world):
                out[r].append(torch.cat(per_rank[r]))
    return out


def write_deepspeed(folder: Path, shapes: list[dict[str, list[int]]], world: int, stage: int, seed: int,
                    damage: DsDamage) -> dict[str, dict[str, torch.Tensor]]:
    """A ``global_step2`` folder; returns {"master"|"exp_avg"|"exp_avg_sq": name -> full tensor}."""
    g = torch.Generator().manual_seed(seed)
    names = [n for grp in shapes for n in grp]
    want = {k: {n: torch.randn(math.prod(s) and s, generator=g) for grp in shapes for n, s in grp.items()}
            for k in ("master", "exp_avg", "exp_avg_sq")}
    parts = {k: _flat_parts(shapes, world, stage, v) for k, v in want.items()}
    folder.mkdir(parents=True)
    saved_shapes = [dict(grp) for grp in shapes]
    if damage.shape is not None:
        name, shape = damage.shape
        for grp in saved_shapes:
            if name in grp:
                grp[name] = shape
    key, base = ("single_partition_of_fp32_groups", "base_optimizer_state") if stage < 3 else \
        ("fp32_flat_groups", "optimizer_state_dict")
    step = 2.0 if damage.step is None else damage.step
    for r in range(world):
        flats = [stored(t, damage.view.get((r, gi))) for gi, t in enumerate(parts["master"][r])]
        if r == 0 and damage.repeat:
            flats = [flats[0]] * (damage.repeat + 1) + flats[1:]
        if damage.alias:
            flats = [flats[0]] * len(flats)
        state = {gi: {"step": torch.tensor(step), "exp_avg": parts["exp_avg"][r][gi],
                      "exp_avg_sq": parts["exp_avg_sq"][r][gi].clone()} for gi in range(len(shapes))}
        if r == 0 and damage.nan_moment:
            state[0]["exp_avg_sq"][0] = math.nan
        if damage.alias:
            state = dict.fromkeys(state, state[0])
        osd = {"zero_stage": stage, "partition_count": [world] * len(shapes), key: flats,
               base: {"state": state, "param_groups": [{"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-8,
                                                        "weight_decay": 0.0, "params": [gi]}
                                                       for gi in range(len(shapes))]}}
        torch.save({"optimizer_state_dict": osd}, folder / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    client: Any = []
    for _ in range(damage.dag):
        client = [client, client]
    model = {"module": {n: (want["master"][n] if stage < 3 else torch.empty(0)) for n in names},
             "buffer_names": [], "param_shapes": saved_shapes, "global_steps": damage.global_steps,
             "skipped_steps": 0, "lr_scheduler": None, "dag": client,
             **({"frozen_param_shapes": {}, "frozen_param_fragments": {}} if stage == 3 else {})}
    files = ["mp_rank_00_model_states.pt"] if stage < 3 else \
        [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)]
    for f in files:
        torch.save(model, folder / f)
    return want


def expected_deepspeed(shapes: list[dict[str, list[int]]], world: int, stage: int, damage: DsDamage,
                       want: dict) -> dict[str, torch.Tensor] | None:
    """The masters a correct reader returns from what the files really say (the stored views'
    values, cut by the saved ``param_shapes`` as DeepSpeed lays parameters out), or None when the
    files are inconsistent (it must refuse)."""
    if damage.repeat or damage.nan_moment or (damage.step is not None and not math.isfinite(damage.step)):
        return None
    if not isinstance(damage.global_steps, int) or isinstance(damage.global_steps, bool) or damage.global_steps < 0:
        return None
    saved = [dict(grp) for grp in shapes]
    if damage.shape is not None and stage < 3 and any(g.get(damage.shape[0]) not in (None, damage.shape[1])
                                                        for g in shapes):
        return None  # the module's own tensor has the true shape: a mismatch is refused
    if damage.alias:
        if any(list(g.values()) != list(shapes[0].values()) for g in shapes):
            return None
        want = {"master": {n: want["master"][n0] for g in shapes for n, n0 in zip(g, shapes[0], strict=True)}}
    if damage.shape is not None:
        for grp in saved:
            if damage.shape[0] in grp:
                grp[damage.shape[0]] = damage.shape[1]
    parts = []
    for r, row in enumerate(_flat_parts(shapes, world, stage, want["master"])):
        got = [value_of(stored(t, damage.view[(r, gi)])) if (r, gi) in damage.view else t
               for gi, t in enumerate(row)]
        if any(x is None or not torch.isfinite(x).all() for x in got):
            return None
        parts.append(got)
    return _cut(saved, parts, world, stage)


def _cut(saved: list[dict[str, list[int]]], parts: list[list[torch.Tensor]], world: int, stage: int
         ) -> dict[str, torch.Tensor] | None:
    out = {}
    for gi, group in enumerate(saved):
        need = [math.prod(s) for s in group.values()]
        if stage < 3:
            full = torch.cat([p[gi] for p in parts])
            if sum(need) > full.numel() or full.numel() - sum(need) >= 2 * world:
                return None
            pos = 0
            for (n, s), k in zip(group.items(), need, strict=True):
                out[n] = full[pos:pos + k].view(s)
                pos += k
        else:
            total = sum(math.ceil(k / world) for k in need)
            if any(p[gi].numel() != total for p in parts):
                return None
            pos = 0
            for (n, s), k in zip(group.items(), need, strict=True):
                part = math.ceil(k / world)
                out[n] = torch.cat([p[gi][pos:pos + part] for p in parts])[:k].view(s)
                pos += part
    return out


# ---- DCP -------------------------------------------------------------------------------------

@dataclass
class DcpDamage:
    """Changes to a DCP ``.metadata`` (all None/empty: an honest one)."""

    size: tuple[str, list[int]] | None = None  # a tensor's claimed full size
    chunk: tuple[str, int, list[int], list[int]] | None = None  # (key, chunk index, offsets, sizes)
    storage: tuple[str, int, int, int] | None = None  # (key, chunk index, offset delta, new length or -1)
    share: tuple[str, str] | None = None  # key B's first item points at key A's first item's bytes
    view: tuple[str, tuple[int, int, int, int]] | None = None  # a 1-D key's first chunk stored as a view
    dag: int = 0  # a 2**dag-path chain of lists in the planner data (shared references)
    noop: bool = False  # set by write_dcp: the metadata damage left the metadata as it was

    def honest(self) -> bool:
        return not (self.view or self.dag) and (self.noop or not (self.size or self.chunk or self.storage
                                                                  or self.share))


def write_dcp(folder: Path, sizes: dict[str, list[int]], parts: int, seed: int, damage: DcpDamage
              ) -> dict[str, torch.Tensor]:
    """A DCP folder (``.metadata`` + ``__0_0.distcp``) of model tensors ``sizes`` (dim 0 split into
    ``parts`` chunks); returns name -> tensor."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    g = torch.Generator().manual_seed(seed)
    want = {n: torch.randn(s, generator=g) for n, s in sizes.items()}
    folder.mkdir(parents=True)
    blob, sdm, storage, planner = bytearray(), {}, {}, {}
    for name, t in want.items():
        bounds = sorted({0, t.shape[0], *(t.shape[0] * i // parts for i in range(1, parts))})
        chunks = []
        for ci, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False)):
            piece = t[lo:hi].clone()
            torch_obj = stored(piece, damage.view[1]) if damage.view and damage.view[0] == name and ci == 0 \
                else piece
            buf = _save_bytes(torch_obj)
            offs = [lo] + [0] * (t.dim() - 1)
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(offs), sizes=piece.shape))
            storage[MetadataIndex(name, torch.Size(offs), ci)] = _StorageInfo("__0_0.distcp", len(blob), len(buf))
            blob += buf
        sdm[name] = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=t.shape,
                                          chunks=chunks)
        planner[name] = ("model", name)
    before = pickle.dumps((sdm, storage))
    _damage_dcp(sdm, storage, planner, damage, ChunkStorageMetadata, _StorageInfo)
    damage.noop = pickle.dumps((sdm, storage)) == before
    (folder / "__0_0.distcp").write_bytes(bytes(blob))
    (folder / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata=sdm, planner_data=planner,
                                                             storage_data=storage)))
    return want


def _save_bytes(obj: Any) -> bytes:
    import io

    b = io.BytesIO()
    torch.save(obj, b)
    return b.getvalue()


def _damage_dcp(sdm: dict, storage: dict, planner: dict, d: DcpDamage, Chunk: type, Info: type) -> None:
    if d.size:
        name, size = d.size
        sdm[name].size = torch.Size(size)
    if d.chunk:
        name, ci, offs, sizes = d.chunk
        chunks = sdm[name].chunks
        chunks[ci % len(chunks)] = Chunk(offsets=torch.Size(offs), sizes=torch.Size(sizes))
    by_key = collections.defaultdict(list)
    for idx in storage:
        by_key[idx.fqn].append(idx)
    if d.storage:
        name, ci, delta, length = d.storage
        idx = by_key[name][ci % len(by_key[name])]
        old = storage[idx]
        storage[idx] = Info(old.relative_path, max(0, old.offset + delta), old.length if length < 0 else length)
    if d.share:
        a, b = d.share
        storage[by_key[b][0]] = storage[by_key[a][0]]
    if d.dag:
        chain: Any = []
        for _ in range(d.dag):
            chain = [chain, chain]
        planner["__dag__"] = chain


def expected_dcp(want: dict[str, torch.Tensor], parts: int, damage: DcpDamage) -> dict[str, torch.Tensor] | None:
    """What a correct reader returns (None: the files are inconsistent, it must refuse): the
    tensors written, with a stored view's values in place of its chunk; a DAG in planner data
    the reader does not use changes nothing."""
    if not damage.noop and (damage.size or damage.chunk or damage.storage or damage.share):
        return None
    if not damage.view:
        return want
    name, view = damage.view
    t = want[name]
    hi = t.shape[0] // parts if parts > 1 and t.shape[0] // parts > 0 else t.shape[0]
    got = value_of(stored(t[:hi].clone(), view))
    if got is None or got.shape != t[:hi].shape:
        return None
    out = dict(want)
    out[name] = torch.cat([got, t[hi:]])
    return out


def deepspeed_from_shardwise(src: Path, folder: Path) -> None:
    """Rewrite the shardwise checkpoint ``src`` (a tag folder) in DeepSpeed's ZeRO-2 layout at world 1
    (what ``engine.save_checkpoint`` of DeepSpeed writes): the same masters, Adam moments, step,
    param groups and counters; no client state (a plain DeepSpeed run saves none)."""
    from shardwise.checkpoint.formats import open_checkpoint

    meta, reader = open_checkpoint(src)
    assert len(meta["param_groups"]) == 1, "one param group (shardwise metadata does not list members)"
    groups = [[n for n in meta["order"] if n in meta["tensors"]]]
    shapes = [{n: meta["tensors"][n]["shape"] for n in g} for g in groups]

    def flat(prefix: str, group: dict) -> torch.Tensor:
        parts = []
        for n in group:
            buf = torch.empty(meta["tensors"][n]["numel"])
            reader.read_range(f"{prefix}/{n}", meta["tensors"][n]["segments"], 0, buf.numel(), buf)
            parts.append(buf)
        out = torch.cat(parts)
        return torch.cat([out, torch.zeros((-out.numel()) % 2)])  # DeepSpeed pads to 2 x world

    step = next(iter(meta["scalars"].values()))["step"]["value"]
    state = {gi: {"step": torch.tensor(float(step)), **{k: flat(k, g) for k in meta["states"]}}
             for gi, g in enumerate(shapes)}
    pgs = [{**pg, "params": [gi]} for gi, pg in enumerate(meta["param_groups"])]
    osd = {"zero_stage": 2, "partition_count": [1] * len(shapes),
           "single_partition_of_fp32_groups": [flat("master", g) for g in shapes],
           "base_optimizer_state": {"state": state, "param_groups": pgs}}
    folder.mkdir(parents=True)
    torch.save({"optimizer_state_dict": osd}, folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    module = {n: torch.zeros(s) for g in shapes for n, s in g.items()}
    torch.save({"module": module, "buffer_names": [], "param_shapes": shapes, "lr_scheduler": meta["lr_scheduler"],
                "global_steps": meta["counters"]["global_steps"], "skipped_steps": 0},
               folder / "mp_rank_00_model_states.pt")
