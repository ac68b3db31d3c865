"""Optimizer states on NVMe: each group's master shard and optimizer state live in its swap file, and
only ``buffer_count`` host buffers of one group each exist (ZeRO-Infinity's optimizer offload).

Between steps a swapped master is a stand-in: one NaN seen ``numel`` times (stride 0), so its shape is
the shard's (its gradient attaches as with CPU offload) while reading it gives NaN and writing it
raises; the state tensors are stand-ins of the same kind. ``step_and_publish`` then goes group by
group, the same arithmetic as CPU offload (each group's master stepped with its param group's options
narrowed to it, as ``bucket_step.py`` and ``low_precision.py`` do, exact for torch's elementwise
optimizers), in a pipeline: with ``pipeline_read`` the reads of the next groups are in flight while
this one steps (and the first ``buffer_count - 1`` groups of the next step are read at the end of a
step, so their reads overlap the next forward and backward), with ``pipeline_write`` the write of the
last is; without them each transfer is waited for (DeepSpeed's meaning of the two keys). Host bytes
held: ``buffer_count`` x the largest group's file (its master and state slots, each rounded up to 4 KiB,
plus a 4 KiB header).
"""

from __future__ import annotations

import inspect
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import optim

from shardwise.aio import AioConfig, AlignedBuffer, IOEngine, open_file
from shardwise.errors import UserError
from shardwise.nvme.folder import SwapFolder, check_room
from shardwise.nvme.swap_file import SwapLayout, check, stamp
from shardwise.zero.bucket_step import steps_exactly_per_group
from shardwise.zero.low_precision import COMPENSATION, is_low_precision, kept_state_dtype, step_group

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
    local_ranks: int = 1
    aio: AioConfig = field(default_factory=AioConfig)


def stand_in(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``numel`` elements that reads NaN and refuses writes (one element, stride 0)."""
    return torch.full((1,), float("nan"), dtype=dtype).expand(numel)


def is_stand_in(t: Any) -> bool:
    return torch.is_tensor(t) and t.dim() == 1 and t.numel() > 1 and t.stride() == (0,)


def state_keys(optimizer: optim.Optimizer, g: ShardedGroup) -> list[tuple[str, torch.dtype]]:
    """The per-element state ``optimizer`` keeps for ``g``'s master, and its dtypes, found by stepping a
    2-element probe with a fresh optimizer of the same class and the options of ``g``'s param group
    (``amsgrad`` in one group only adds a state there)."""
    probe = torch.zeros(2, dtype=torch.float32)
    probe.grad = torch.zeros(2)
    accepted = inspect.signature(type(optimizer).__init__).parameters
    options = next((pg for pg in optimizer.param_groups if any(p is g.master for p in pg["params"])),
                   optimizer.defaults)
    twin = type(optimizer)([probe], **{k: v for k, v in options.items() if k in accepted and k != "params"})
    twin.step()
    keys = sorted(k for k, v in twin.state[probe].items() if torch.is_tensor(v) and v.numel() == 2)
    if kept_state_dtype(g, COMPENSATION) is not None:
        keys.append(COMPENSATION)
    return [(k, kept_state_dtype(g, k)) for k in keys]


class OptimizerSwapper:
    """The swap files of ``groups`` (this rank's trainable groups) and the pipeline that steps them."""

    def __init__(self, groups: list[ShardedGroup], optimizer: optim.Optimizer, settings: NvmeSettings, rank: int):
        if not steps_exactly_per_group(optimizer, subclasses=True):
            raise UserError(f"{settings.key.rsplit('.', 1)[0]}.device: NVMe offload steps one group at a time, "
                            "exact for torch's elementwise optimizers (Adam, AdamW, SGD, ...) and DeepSpeed's "
                            "(DeepSpeedCPUAdam, FusedAdam, ...) without step hooks; "
                            f"got {type(optimizer).__name__}")
        self.optimizer, self.settings = optimizer, settings
        self.units = [(i, g) for i, g in enumerate(groups) if g.master is not None]
        self.folder = SwapFolder(settings.key, settings.nvme_path, rank)
        self.io = IOEngine(settings.aio)
        # a read and its check, a stamp and its write, off the main thread (torch's sum releases the GIL)
        self.workers = ThreadPoolExecutor(2, thread_name_prefix="shardwise-nvme")
        self.files: list = []
        self.prefetched: deque[tuple[AlignedBuffer, Future]] = deque()  # the next step's first reads
        try:
            self._open(settings)
        except BaseException:
            self.close()  # refused (no room) or a first write failed: the lock, threads and files go now
            raise

    def _open(self, settings: NvmeSettings) -> None:
        """The layouts (room checked), the files and buffers; the masters (and any state) to disk."""
        self.layouts = [SwapLayout.build(self.folder.file(f"group{i:05d}.swap"), g.own_numel, g.master.dtype,
                                         state_keys(self.optimizer, g)) for i, g in self.units]
        self.disk_bytes = sum(layout.nbytes for layout in self.layouts)
        check_room(settings.key, Path(settings.nvme_path), self.disk_bytes, settings.local_ranks)
        for layout in self.layouts:
            self.files.append(open_file(layout.path))
        size = max((layout.nbytes for layout in self.layouts), default=4096)
        count = max(1, min(settings.buffer_count, len(self.units)))  # more buffers than groups would sit idle
        self.buffers = [AlignedBuffer(size, settings.pin_memory) for _ in range(count)]
        self.free = list(self.buffers)
        for u, (_, g) in enumerate(self.units):  # the masters (and any state) to disk, their host copies dropped
            buf = self.free[0]
            self._fill(u, buf)
            self._write(u, buf)
            g.master_swap = self  # an edit of the parameters (adopt_full) writes through overwrite_master

    # -- one group in and out ---------------------------------------------------------
    def _tensors(self, u: int) -> dict[str, torch.Tensor]:
        g = self.units[u][1]
        state = self.optimizer.state.get(g.master, {})
        return {"master": g.master, **{k: v for k, v in state.items() if torch.is_tensor(v)}}

    @torch.no_grad()
    def _fill(self, u: int, buf: AlignedBuffer) -> None:
        """Copy group ``u``'s tensors into ``buf`` (where they are not there already), leave stand-ins."""
        layout, g = self.layouts[u], self.units[u][1]
        live = self._tensors(u)
        keys = {s.key for s in layout.slots}
        extra = [k for k, v in live.items() if v.numel() == g.own_numel and k not in keys and k != "step"]
        if extra:
            raise RuntimeError(f"{layout.path}: the optimizer keeps state {extra} its swap file has no slot for")
        for slot in layout.slots:
            t = live.get(slot.key)
            if t is not None:
                view = buf.view(slot.dtype, slot.offset, slot.numel)
                if t.data_ptr() != view.data_ptr():
                    view.copy_(t)
        layout.has_state = all(s.key in live for s in layout.slots)
        self._leave(u)

    def _write(self, u: int, buf: AlignedBuffer) -> None:
        """Stamp ``buf`` (generation, checksum) and write it as group ``u``'s file (a worker runs it)."""
        self.io.write(self.files[u], buf.tensor[:stamp(self.layouts[u], buf.tensor)]).wait()

    def _read(self, u: int, buf: AlignedBuffer) -> None:
        """Read group ``u``'s file into ``buf`` and check it (a worker runs it)."""
        layout = self.layouts[u]
        self.io.read(self.files[u], buf.tensor[:layout.used()]).wait()
        check(layout, buf.tensor)

    def _leave(self, u: int) -> None:
        """Stand-ins in place of group ``u``'s master and state (the buffer may be reused from now on)."""
        g = self.units[u][1]
        g.master.set_(stand_in(g.own_numel, g.master.dtype))
        state = self.optimizer.state.get(g.master)
        for slot in self.layouts[u].slots[1:]:
            if state is not None and slot.key in state:
                state[slot.key] = stand_in(slot.numel, slot.dtype)

    @torch.no_grad()
    def _enter(self, u: int, buf: AlignedBuffer) -> None:
        """Point group ``u``'s master and state at ``buf`` (read and checked)."""
        layout, g = self.layouts[u], self.units[u][1]
        g.master.set_(buf.view(g.master.dtype, layout.slots[0].offset, g.own_numel))
        if layout.has_state:
            state = self.optimizer.state[g.master]
            for slot in layout.slots[1:]:
                state[slot.key] = buf.view(slot.dtype, slot.offset, slot.numel)

    # -- the step ----------------------------------------------------------------------
    def _acquire(self, writes: deque) -> AlignedBuffer:
        while not self.free:
            buf, handle = writes.popleft()
            try:
                handle.result()
            finally:
                self.free.append(buf)
        return self.free.pop()

    def _step_one(self, u: int, group_of: dict[int, dict]) -> None:
        index, g = self.units[u]
        options = {k: v for k, v in group_of[id(g.master)].items() if k != "params"}
        if is_low_precision(g):
            step_group(self.optimizer, g, options, index)
            return
        whole = self.optimizer.param_groups
        try:
            self.optimizer.param_groups = [{**options, "params": [g.master]}]
            self.optimizer.step()
        finally:
            self.optimizer.param_groups = whole

    def _step_in(self, u: int, buf: AlignedBuffer, group_of: dict[int, dict]) -> None:
        """Step group ``u`` in ``buf`` and publish it. Raising (the optimizer refused: offload_states' hook),
        the group goes back to its stand-ins (its file still holds it) and ``buf`` to the free list."""
        g = self.units[u][1]
        try:
            self._enter(u, buf)
            self._step_one(u, group_of)
            g.publish_master(async_op=True)
            g.master_writable()  # the device copy out of the buffer has read it (host_copy.py, rule 4)
        except BaseException:
            self._leave(u)
            self.free.append(buf)
            raise

    @torch.no_grad()
    def step_and_publish(self, sharding: Any) -> None:
        """Step every group through its swap file and publish it (as ``bucket_step.step_and_publish``)."""
        opt, s = self.optimizer, self.settings
        group_of = {id(p): pg for pg in opt.param_groups for p in pg["params"]}
        ahead = len(self.buffers) - 1 if s.pipeline_read else 0
        reads, self.prefetched = self.prefetched, deque()  # read during the forward and backward
        writes: deque[tuple[AlignedBuffer, Future]] = deque()
        issued = len(reads)
        try:
            for u in range(len(self.units)):
                while issued < len(self.units) and (issued <= u + ahead):
                    buf = self._acquire(writes)
                    reads.append((buf, self.workers.submit(self._read, issued, buf)))
                    issued += 1
                buf, handle = reads.popleft()
                self._drain(deque([(buf, handle)]), keep=buf)
                self._step_in(u, buf, group_of)
                self._fill(u, buf)
                writes.append((buf, self.workers.submit(self._write, u, buf)))
                if not s.pipeline_write:
                    self._drain(writes)
        finally:
            self._drain(writes, reads)
        sharding.wait_for_params()
        if s.pipeline_read:  # the next step's first groups, read while the next forward and backward run
            for u in range(min(ahead, len(self.units))):
                buf = self.free.pop()
                self.prefetched.append((buf, self.workers.submit(self._read, u, buf)))

    def drop_prefetched(self) -> None:
        """Forget the reads issued for the next step (before anything else reads or writes the files)."""
        reads, self.prefetched = self.prefetched, deque()
        self._drain(deque(), reads)

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

    # -- everything resident, for a checkpoint -------------------------------------------
    @contextmanager
    def resident(self, write_back: bool):
        """Every group's master and state in host memory (buffers of their own) for the body: a save
        reads them, a load (``write_back``) writes them and they go back to disk after."""
        self.drop_prefetched()  # a load writes the files: a read issued before would be stale
        bufs: list[AlignedBuffer] = []
        try:
            for u, layout in enumerate(self.layouts):
                buf = AlignedBuffer(layout.nbytes)
                self._read(u, buf)
                self._enter(u, buf)
                bufs.append(buf)  # only a group read and checked is written back (never its stand-ins)
            yield
        finally:
            for u, buf in enumerate(bufs):
                if write_back:
                    self._fill(u, buf)
                    self._write(u, buf)
                else:
                    self._leave(u)

    @torch.no_grad()
    def overwrite_master(self, g: ShardedGroup, src: torch.Tensor) -> None:
        """``g``'s master becomes ``src`` (an edit of the parameters), in its swap file; the state stays."""
        self.drop_prefetched()
        u = next(i for i, (_, h) in enumerate(self.units) if h is g)
        buf = AlignedBuffer(self.layouts[u].nbytes)
        self._read(u, buf)
        self._enter(u, buf)
        g.master.copy_(src)
        self._fill(u, buf)
        self._write(u, buf)

    # -- reports and the end -------------------------------------------------------------
    def host_bytes(self) -> int:
        """The host memory NVMe offload holds: its buffers (``buffer_count`` x the largest file)."""
        return sum(b.nbytes for b in self.buffers)

    def close(self) -> None:
        """Stop the I/O threads, close and remove the swap files, release the lock."""
        try:
            self.drop_prefetched()
        except Exception:  # noqa: BLE001, S110 - closing: a failed read-ahead of a step that never comes
            pass
        self.workers.shutdown(wait=True)
        self.io.close()
        for f in self.files:
            f.close()
        self.folder.close()
