"""Optimizer states on NVMe: each piece of a group's master shard (the whole shard, or ``sub_group_size``
elements of it: ``pieces.py``) and its optimizer state live in a swap file, and only ``buffer_count`` host
buffers of one piece each exist (ZeRO-Infinity's optimizer offload).

Between steps a swapped master is a stand-in: one NaN seen ``numel`` times (stride 0), so its shape is
the shard's while reading it gives NaN and writing it raises; the state tensors are stand-ins of the same
kind. The step's gradients stay where the reduction left them: :meth:`OptimizerSwapper.grad_norm` streams
them through one host buffer for the norm, and each piece's is copied into its own buffer's gradient slot
as it steps (``pieces.py``), so no gradient shard is held on the host. ``step_and_publish`` then goes piece
by piece, the same arithmetic as CPU offload (each group's master stepped with its param group's options
narrowed to it, as ``bucket_step.py`` and ``low_precision.py`` do, exact for elementwise optimizers), in a
pipeline: with ``pipeline_read`` the reads of the next pieces are in flight while this one steps (and the
first ``buffer_count - 1`` pieces of the next step are read at the end of a step, so their reads overlap
the next forward and backward), with ``pipeline_write`` the write of the last is; without them each
transfer is waited for (DeepSpeed's meaning of the two keys). Host bytes held, by construction::

    buffer_count x (4 KiB + sum over the master and each state of align_4KiB(k_i x S) + align_4KiB(g x S))
    (+ g x G_split for the norm when a group is split)

``S`` the largest piece, ``g`` the master's bytes per element (its gradient slot), ``G_split`` the largest
split group's shard.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import optim

from shardwise.aio import ALIGN, AioConfig, AlignedBuffer, IOEngine, align_up, open_file
from shardwise.errors import UserError
from shardwise.nvme.folder import SwapFolder, check_room
from shardwise.nvme.pieces import copy_scaled, plan, scalars_of, stand_in, state_keys, step_low_piece, step_piece
from shardwise.nvme.resident import Resident
from shardwise.nvme.swap_file import SwapLayout, check, stamp
from shardwise.optim.grad_norm import grad_square
from shardwise.zero.bucket_step import steps_exactly_per_group
from shardwise.zero.host_copy import accelerated, fence
from shardwise.zero.low_precision import is_low_precision, step_group

if TYPE_CHECKING:
    from shardwise.zero.flat_group import ShardedGroup


@dataclass(frozen=True)
class NvmeSettings:
    """``offload_optimizer`` with ``device: nvme`` and the ``aio`` section, read once by the engine.
    ``local_ranks``: the ranks of this node, which share the disk (the room check counts them all)."""

    nvme_path: Path
    key: str = "zero_optimization.offload_optimizer.nvme_path"
    buffer_count: int = 4
    pipeline_read: bool = False
    pipeline_write: bool = False
    pin_memory: bool = False
    sub_group_size: int = 1_000_000_000  # zero_optimization.sub_group_size: elements of one piece (pieces.py)
    local_ranks: int = 1
    aio: AioConfig = field(default_factory=AioConfig)


class OptimizerSwapper(Resident):
    """The swap files of ``groups`` (this rank's trainable groups, cut into ``sub_group_size`` pieces) and the
    pipeline that steps them."""

    def __init__(self, groups: list[ShardedGroup], optimizer: optim.Optimizer, settings: NvmeSettings, rank: int):
        if not steps_exactly_per_group(optimizer, subclasses=True):
            raise UserError(f"{settings.key.rsplit('.', 1)[0]}.device: NVMe offload steps one group at a time, "
                            "exact for torch's elementwise optimizers (Adam, AdamW, SGD, ...) and DeepSpeed's "
                            "(DeepSpeedCPUAdam, FusedAdam, ...) without step hooks; "
                            f"got {type(optimizer).__name__}")
        self.optimizer, self.settings = optimizer, settings
        self.units = [(i, g) for i, g in enumerate(groups) if g.master is not None]
        self.pieces = plan(self.units, settings.sub_group_size)
        self.by_group: dict[int, list[int]] = {}
        for u, piece in enumerate(self.pieces):
            self.by_group.setdefault(id(piece.group), []).append(u)
        self.unscale, self.coef = 1.0, 1.0  # this step's gradient factors (grad_norm, clip)
        self.folder = SwapFolder(settings.key, settings.nvme_path, rank)
        self.io = IOEngine(settings.aio)
        # a read and its check, a stamp and its write, off the main thread (torch's sum releases the GIL)
        self.workers = ThreadPoolExecutor(2, thread_name_prefix="shardwise-nvme")
        self.files: list = []
        self.staging: AlignedBuffer | None = None
        self.prefetched: deque[tuple[AlignedBuffer, Future]] = deque()  # the next step's first reads
        self.writing: deque[tuple[AlignedBuffer, Future]] = deque()  # the last step's last writes, in flight
        self.write_of: dict[int, Future] = {}  # piece -> its latest write (a read of it waits for it)
        try:
            self._open(settings)
        except BaseException:
            self.close()  # refused (no room) or a first write failed: the lock, threads and files go now
            raise

    def _open(self, settings: NvmeSettings) -> None:
        """The layouts (room checked), the files and buffers; the masters (and any state) to disk."""
        keys = {id(g): state_keys(self.optimizer, g) for _, g in self.units}
        self.layouts = [SwapLayout.build(self.folder.file(p.name), p.numel, p.group.master.dtype, keys[id(p.group)])
                        for p in self.pieces]
        self.disk_bytes = sum(layout.nbytes for layout in self.layouts)
        check_room(settings.key, Path(settings.nvme_path), self.disk_bytes, settings.local_ranks)
        for layout in self.layouts:
            self.files.append(open_file(layout.path))
        # a buffer: the largest file, then the gradient slot of the largest piece (never written to disk)
        self.grad_at = max((layout.nbytes for layout in self.layouts), default=ALIGN)
        grad_bytes = max((p.numel * p.group.master.element_size() for p in self.pieces), default=1)
        count = max(1, min(settings.buffer_count, len(self.pieces)))  # more buffers than pieces would sit idle
        self.buffers = [AlignedBuffer(self.grad_at + align_up(grad_bytes), settings.pin_memory) for _ in range(count)]
        self.free = list(self.buffers)
        split = [p.group.own_numel * p.group.master.element_size() for p in self.pieces if not p.whole]
        if split:  # the norm of a split group is taken on its whole gradient (bit for bit CPU offload's)
            self.staging = AlignedBuffer(max(split), settings.pin_memory)
        for _, g in self.units:  # each master made in a buffer a piece at a time and written (never whole)
            g.to_host = None  # the gradient moves through the buffers (pieces.py), no persistent host copy
            for u in self.by_group[id(g)]:
                self._fill(u, self.free[0], self._made(g, u, self.free[0]))
                self._write(u, self.free[0])
            g.master_start, g.master_pending = None, False
            self._leave(g)
            g.master_swap = self  # an edit of the parameters (adopt_full) writes through overwrite_master

    def _made(self, g: ShardedGroup, u: int, buf: AlignedBuffer) -> dict[str, torch.Tensor]:
        """``g``'s tensors at the build, for piece ``u``: the master is still to be made (the builder left a
        stand-in, ``OffloadPolicy.master_later``), so what it starts from is copied into ``buf`` instead: the
        16-bit shard (cast as CPU offload's ``master.copy_`` casts it: the same bits), or, a file-held stage-3
        shard (never cut into pieces), read back from its parameter file into ``buf``'s gradient slot first."""
        live = self._group_tensors(g)
        if not getattr(g, "master_pending", False):  # a master made already: copied from
            return live
        start = g.master_start
        if start is None:
            if not self.pieces[u].whole:
                raise RuntimeError(f"{self.layouts[u].path}: a file-held shard is stepped whole, not in pieces")
            start = buf.view(g.dtype, self.grad_at, g.own_numel)
            g.store.fill(g, start, async_read=False)
        return {**live, "master": start}

    # -- one piece in and out -----------------------------------------------------------
    def _group_tensors(self, g: ShardedGroup) -> dict[str, torch.Tensor]:
        state = self.optimizer.state.get(g.master, {})
        return {"master": g.master, **{k: v for k, v in state.items() if torch.is_tensor(v)}}

    @torch.no_grad()
    def _fill(self, u: int, buf: AlignedBuffer, live: dict[str, Any]) -> None:
        """Copy piece ``u``'s part of ``live`` (the group's tensors, or the piece's own) into ``buf`` (where
        it is not there already)."""
        piece, layout = self.pieces[u], self.layouts[u]
        live = {k: v for k, v in live.items() if torch.is_tensor(v)}
        keys = {s.key for s in layout.slots}
        extra = [k for k, v in live.items() if v.dim() == 1 and v.numel() in (piece.numel, piece.group.own_numel)
                 and k not in keys and k != "step"]
        if extra:
            raise RuntimeError(f"{layout.path}: the optimizer keeps state {extra} its swap file has no slot for")
        for slot in layout.slots:
            t = live.get(slot.key)
            if t is not None:
                t = t if t.numel() == piece.numel else t.narrow(0, piece.start, piece.numel)
                view = buf.view(slot.dtype, slot.offset, slot.numel)
                if t.data_ptr() != view.data_ptr():
                    view.copy_(t)
        layout.has_state = all(s.key in live for s in layout.slots)

    def _write(self, u: int, buf: AlignedBuffer) -> None:
        """Stamp ``buf`` (generation, checksum) and write it as piece ``u``'s file (a worker runs it)."""
        self.io.write(self.files[u], buf.tensor[:stamp(self.layouts[u], buf.tensor)]).wait()

    def _read(self, u: int, buf: AlignedBuffer) -> None:
        """Read piece ``u``'s file into ``buf`` and check it (a worker runs it)."""
        layout = self.layouts[u]
        self.io.read(self.files[u], buf.tensor[:layout.used()]).wait()
        check(layout, buf.tensor)

    def _leave(self, g: ShardedGroup) -> None:
        """Stand-ins in place of ``g``'s master and state (its buffers may be reused from now on)."""
        g.master.grad = None
        g.master.set_(stand_in(g.own_numel, g.master.dtype))
        state = self.optimizer.state.get(g.master)
        for slot in self.layouts[self.by_group[id(g)][0]].slots[1:]:
            if state is not None and slot.key in state:
                state[slot.key] = stand_in(g.own_numel, slot.dtype)

    @torch.no_grad()
    def _enter(self, u: int, buf: AlignedBuffer) -> None:
        """Point a whole piece's group master and state at ``buf`` (read and checked)."""
        layout, g = self.layouts[u], self.pieces[u].group
        g.master.set_(buf.view(g.master.dtype, layout.slots[0].offset, g.own_numel))
        if layout.has_state:
            state = self.optimizer.state[g.master]
            for slot in layout.slots[1:]:
                state[slot.key] = buf.view(slot.dtype, slot.offset, slot.numel)

    # -- the gradients: a norm pass, then each piece's into its buffer ---------------------
    @torch.no_grad()
    def grad_norm(self, sharding: Any, unscale: float) -> float:
        """The step's gradient norm, CPU offload's to the bit, with no gradient kept on the host: each
        group's reduced gradient is cast, scaled and squared in one host buffer, then dropped (pieces.py)."""
        for g in sharding.groups:
            g.wait()
            g.wait_gathered()
        self.unscale, self.coef = unscale, 1.0
        squares = []
        for g in sharding.groups:
            src = g.owned_grad()
            if g.replicate is not None:  # hybrid sharding: summed over the replicas once, here
                g.replicate.all_reduce(src)
            squares.append(grad_square(copy_scaled(self._staging(g), src, unscale, 1.0)))
        return sharding.grad_norm(squares, squared=True)

    def clip(self, coef: float) -> None:
        """Gradient clipping: every piece's gradient is multiplied by ``coef`` as it is loaded."""
        self.coef = coef

    def _staging(self, g: ShardedGroup) -> torch.Tensor:
        """Host room for ``g``'s whole gradient: a free buffer's gradient slot, or (a split group) the staging."""
        if self.staging is not None and g.own_numel * g.master.element_size() > self.buffers[0].nbytes - self.grad_at:
            return self.staging.view(g.master.dtype, 0, g.own_numel)
        if not self.free:  # every buffer read ahead or still written behind: the oldest write first
            self.free.append(self._acquire(self.writing))
        return self.free[-1].view(g.master.dtype, self.grad_at, g.own_numel)

    def _grad(self, u: int, buf: AlignedBuffer) -> torch.Tensor:
        piece = self.pieces[u]
        g = piece.group
        dst = buf.view(g.master.dtype, self.grad_at, piece.numel)
        return copy_scaled(dst, g.owned_grad().narrow(0, piece.start, piece.numel), self.unscale, self.coef)

    # -- the step ----------------------------------------------------------------------
    def _reap(self, writes: deque) -> None:
        """Give back the buffers of the writes already finished (oldest first), without waiting."""
        while writes and writes[0][1].done():
            buf, handle = writes.popleft()
            try:
                handle.result()
            finally:
                self.free.append(buf)

    def _acquire(self, writes: deque) -> AlignedBuffer:
        while not self.free:
            buf, handle = writes.popleft()
            try:
                handle.result()
            finally:
                self.free.append(buf)
        return self.free.pop()

    def _step_one(self, u: int, options: dict) -> None:
        g = self.pieces[u].group
        if is_low_precision(g):
            step_group(self.optimizer, g, options, self.pieces[u].index)
            return
        whole = self.optimizer.param_groups
        try:
            self.optimizer.param_groups = [{**options, "params": [g.master]}]
            self.optimizer.step()
        finally:
            self.optimizer.param_groups = whole

    def _step_split(self, u: int, buf: AlignedBuffer, grad: torch.Tensor, options: dict) -> dict[str, Any]:
        """Step a piece of a split group (pieces.py) and publish it; returns its state for the file."""
        piece, layout = self.pieces[u], self.layouts[u]
        g = piece.group
        master = buf.view(g.master.dtype, layout.slots[0].offset, piece.numel)
        state = None
        if layout.has_state:
            state = {**scalars_of(self.optimizer.state.get(g.master, {}), g.own_numel),
                     **{s.key: buf.view(s.dtype, s.offset, s.numel) for s in layout.slots[1:]}}
        if is_low_precision(g):
            new = step_low_piece(self.optimizer, options, g, master, grad, state, piece.index)
        else:
            new = step_piece(self.optimizer, options, master, grad, state)
        g.publish_piece(master, piece.start)
        if piece.last:  # the group's scalars (Adam's step) are every piece's, the per-element state on disk
            self.optimizer.state[g.master] = {**scalars_of(new, piece.numel), **{
                s.key: stand_in(g.own_numel, s.dtype) for s in layout.slots[1:] if s.key in new}}
            g.publish_master(async_op=True, copied=True)
        return {"master": master, **new}

    def _step_in(self, u: int, buf: AlignedBuffer, group_of: dict[int, dict]) -> None:
        """Step piece ``u`` in ``buf`` and publish it. Raising (the optimizer refused: offload_states' hook),
        the group goes back to its stand-ins (its files still hold it) and ``buf`` to the free list."""
        piece = self.pieces[u]
        g = piece.group
        options = {k: v for k, v in group_of[id(g.master)].items() if k != "params"}
        try:
            grad = self._grad(u, buf)
            if piece.whole:
                self._enter(u, buf)
                g.master.grad = grad
                self._step_one(u, options)
                g.publish_master(async_op=True)
                live = self._group_tensors(g)
            else:
                live = self._step_split(u, buf, grad, options)
            if accelerated(g.device):
                fence(g.device)  # the copy to the device out of the buffer has read it (host_copy.py, rule 4)
            self._fill(u, buf, live)
            if piece.last:
                g.release_grad_shard()  # stage 3: the reduced 16-bit shard is read no more this step
                self._leave(g)
        except BaseException:
            self._leave(g)
            self.free.append(buf)
            raise

    def _submit_read(self, u: int, buf: AlignedBuffer) -> Future:
        """Read piece ``u`` into ``buf`` on a worker, after its last write (still in flight with write-behind)."""
        pending = self.write_of.pop(u, None)
        if pending is not None:  # waited, not raised here: its error comes from the drain that frees its buffer
            wait([pending])
        return self.workers.submit(self._read, u, buf)

    def _submit_write(self, u: int, buf: AlignedBuffer) -> tuple[AlignedBuffer, Future]:
        self.write_of[u] = handle = self.workers.submit(self._write, u, buf)
        return buf, handle

    @torch.no_grad()
    def step_and_publish(self, sharding: Any) -> None:
        """Step every piece through its swap file and publish it (as ``bucket_step.step_and_publish``); the
        gradients are the ones :meth:`grad_norm` measured, times :meth:`clip`'s coefficient. With
        ``pipeline_write`` the last writes go on during the next forward and backward (write-behind)."""
        opt, s = self.optimizer, self.settings
        group_of = {id(p): pg for pg in opt.param_groups for p in pg["params"]}
        ahead = len(self.buffers) - 1 if s.pipeline_read else 0
        reads, self.prefetched = self.prefetched, deque()  # read during the forward and backward
        writes, self.writing = self.writing, deque()  # the last step's write-behind, if still in flight
        issued = len(reads)
        try:
            for u in range(len(self.pieces)):
                self._reap(writes)
                # read ahead into buffers that are free now; wait for one only for the piece needed now
                # (waiting for a write just issued before stepping would put the step after the I/O)
                while issued < len(self.pieces) and issued <= u + ahead and (self.free or issued == u):
                    buf = self._acquire(writes)
                    reads.append((buf, self._submit_read(issued, buf)))
                    issued += 1
                buf, handle = reads.popleft()
                self._drain(deque([(buf, handle)]), keep=buf)
                self._step_in(u, buf, group_of)
                writes.append(self._submit_write(u, buf))
                if not s.pipeline_write:
                    self._drain(writes)
        except BaseException:
            self._drain(writes, reads)
            raise
        self.writing = writes
        sharding.wait_for_params()
        if s.pipeline_read:  # the next step's first pieces, read while the next forward and backward run
            for u in range(min(ahead, len(self.pieces))):
                buf = self._acquire(self.writing)
                self.prefetched.append((buf, self._submit_read(u, buf)))

    def drop_prefetched(self) -> None:
        """Finish the write-behind and forget the reads issued for the next step (before anything else
        reads or writes the files)."""
        reads, self.prefetched = self.prefetched, deque()
        writes, self.writing = self.writing, deque()
        self.write_of.clear()
        self._drain(writes, reads)

    def _drain(self, writes: deque, reads: deque | None = None, keep: AlignedBuffer | None = None) -> None:
        """Wait for every transfer in ``writes`` (and ``reads``), giving their buffers back (``keep``: not
        that one, unless its transfer failed); then raise the first error, if any."""
        error: BaseException | None = None
        for queue in (writes, reads or deque()):
            while queue:
                buf, handle = queue.popleft()
                try:
                    handle.result()
                except BaseException as e:  # noqa: BLE001 - every transfer waited for, the first error raised
                    error = error or e
                if buf is not keep or error is not None:
                    self.free.append(buf)
        if error is not None:
            raise error

    # -- reports and the end -------------------------------------------------------------
    def host_bytes(self) -> int:
        """The host memory NVMe offload holds: its buffers (and a split group's gradient staging)."""
        return sum(b.nbytes for b in self.buffers) + (self.staging.nbytes if self.staging is not None else 0)

    def close(self) -> None:
        """Stop the I/O threads, close and remove the swap files, release the lock."""
        try:
            self.drop_prefetched()
        except Exception:  # noqa: BLE001, S110 - closing: a read-ahead of a step that never comes, a write-behind of a file removed next
            pass
        self.workers.shutdown(wait=True)
        self.io.close()
        for f in self.files:
            f.close()
        self.folder.close()
