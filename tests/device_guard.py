"""The CPU-run device guard: run a library path with its parameters on a second device, on a CPU.

This machine has no GPU, and a CPU-only torch build cannot make CUDA tensors that autograd accepts
(autograd asks CUDA's device guard for the tensor's stream, and a CPU build has none). What it can
do: ``FakeTensorMode`` tensors on a device that has a guard here, ``lazy:0``. A fake tensor has no
data, only shape, dtype and device, and every op checks its arguments' devices as a real device
would: a ``lazy:0`` tensor meeting a CPU tensor raises ``Expected all tensors to be on the same
device`` (or ``FakeTensor is wrapped to wrong device``, for an in-place op on the CPU side), which
is the error a CUDA run gives. So the guard runs the path for its devices, not its numbers
(``docs/gpu_guard.md``: the mechanism and what it reaches).

Under :func:`device_guard`:

* the library's compute device is ``lazy:0`` (every ``compute_device`` binding is patched), and
  torch's fake process group serves the collectives of a world of ``world`` ranks in this one
  process (sharded paths run as rank 0 of 2, the NCCL branch of ``Comm``, since the backend is not
  gloo);
* a ``non_blocking`` copy from the device to the CPU leaves its destination "in flight" until
  ``torch.cuda.synchronize()``, a stream's or an event's ``synchronize()`` (the guard serves
  ``torch.cuda``'s stream and event classes); any op that reads the destination before that raises
  :class:`HostReadBeforeSync` (a host read of a copy that may not have arrived);
* a host read of a value (``.item()``, ``float()``, ``bool()``) returns 1 (``False`` for a bool: no
  overflow); one of a device value is recorded
  in ``guard.host_syncs`` with the library line that asked (each one stalls a GPU step).
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch._dynamo  # noqa: F401  (imported by FakeTensorMode: before torch.Event is served by the guard)
import torch.distributed as dist
from device_guard_streams import stream_patches
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.multiprocessing.reductions import StorageWeakRef

DEVICE = torch.device("lazy", 0)  # the simulated accelerator: not the CPU, and it has a device guard here
CPU = torch.device("cpu")
_aten = torch.ops.aten


class HostReadBeforeSync(RuntimeError):
    """The host read a non_blocking device-to-host copy before any synchronize or event wait."""


class StreamOrderError(RuntimeError):
    """The compute stream used a device tensor a side stream wrote, before waiting for that stream."""


@dataclass
class Guard:
    """What one guarded run saw (the mixing errors themselves are raised, not recorded)."""

    host_syncs: list[str] = field(default_factory=list)  # library lines that read a device value on the host
    nonblocking_d2h: int = 0  # non_blocking device-to-host copies seen
    syncs: int = 0  # synchronize / event waits seen
    bool_reads: int = 0  # host reads of a bool (an overflow check, a loop's "finished?")
    finish_after: int | None = None  # bool reads answer True after this many (None: always False)
    in_flight: dict = field(default_factory=dict)  # storage -> where the copy was made
    on_side: dict = field(default_factory=dict)  # storage -> the side stream whose copy wrote it
    streams: list = field(default_factory=list)  # the streams entered (``with stream:``), innermost last
    compute_stream: object = None
    answers: dict = field(default_factory=dict)  # library-line substring -> what its host reads give
    # (a number, or (number, bool): the bool for a bool read)

    def library_line(self) -> str:
        """The innermost shardwise frame of the current stack (where a finding is reported)."""
        for fr in reversed(traceback.extract_stack()):
            if "/shardwise/" in fr.filename:
                return f"{fr.filename.split('/shardwise/', 1)[1]}:{fr.lineno} {fr.line}"
        return "(outside shardwise)"

    def library_stack(self) -> str:
        """Every shardwise frame of the current stack (an answer matches any: a ZeRO-3 wrapper of a torch
        function, ``zero/stage3/external.py``, can be the innermost one)."""
        frames = traceback.extract_stack()
        return "\n".join(f"{fr.filename}:{fr.lineno}" for fr in frames if "/shardwise/" in fr.filename)


def _tensors(tree) -> Iterator[torch.Tensor]:
    for x in torch.utils._pytree.tree_leaves(tree):
        if isinstance(x, torch.Tensor):
            yield x


def _storage(t: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())


class _GuardMode(FakeTensorMode):
    """The fake mode, also watching every op: non_blocking D2H copies and the reads after them.

    (One mode, not a second dispatch mode stacked on the fake one: a mode above it also sees
    the fake mode's own meta computations and hands meta tensors back into autograd.)"""

    def __init__(self, guard: Guard):
        super().__init__(allow_non_fake_inputs=True)
        self.guard = guard

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        g = self.guard
        if kwargs.get("generator") is not None:
            _check_generator(func, args, kwargs)
        if func is _aten._local_scalar_dense.default:  # .item() / float() / bool(): values are fake
            line = g.library_line()
            if args[0].device != CPU:
                g.host_syncs.append(line)
            answer = next((v for k, v in g.answers.items() if k in g.library_stack()), None) if g.answers else None
            if answer is not None:  # a check that compares values (equal shard lengths: 0 and 0)
                number, flag = answer if isinstance(answer, tuple) else (answer, bool(answer))
                return flag if args[0].dtype == torch.bool else number
            if args[0].dtype != torch.bool:
                return 1  # a step count, a norm
            g.bool_reads += 1  # False: no overflow, not finished (until finish_after: a loop's stop)
            return g.finish_after is not None and g.bool_reads > g.finish_after
        if g.in_flight and not func.is_view and func.namespace != "prim" \
                and not self._runs_on_device(func, args, kwargs):  # prim: metadata (prim.device), no data read
            written = args[0] if func is _aten.copy_.default else None  # written, not read
            for t in _tensors((args, kwargs)):
                ref = _storage(t) if t.device == CPU and t is not written else None
                if ref is not None and ref in g.in_flight:
                    raise HostReadBeforeSync(
                        f"{func} reads on the host a non_blocking device-to-host copy before any "
                        f"synchronize or event wait; copied at {g.in_flight[ref]}, read at {g.library_line()}")
        side = g.streams[-1] if g.streams and g.streams[-1] is not g.compute_stream else None
        if g.on_side and side is None and not func.is_view and func.namespace != "prim":
            _check_stream_order(g, func, args, kwargs)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if side is not None and func is _aten.copy_.default and args[0].device != CPU:
            g.on_side[_storage(args[0])] = side
        if self._nonblocking_d2h(func, args, kwargs):
            dst = args[0] if func is _aten.copy_.default else out
            g.nonblocking_d2h += 1
            g.in_flight[_storage(dst)] = g.library_line()
        return out

    @staticmethod
    def _runs_on_device(func, args, kwargs) -> bool:  # noqa: ANN001
        """A copy to the device reads the host buffer in its stream's order, after the copy that
        filled it: not a host read."""
        if func is _aten.copy_.default:
            return args[0].device != CPU
        if func is _aten._to_copy.default:
            return kwargs.get("device") is not None and torch.device(kwargs["device"]) != CPU
        return False

    @staticmethod
    def _nonblocking_d2h(func, args, kwargs) -> bool:  # noqa: ANN001
        if func is _aten.copy_.default:
            nb = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            return bool(nb) and args[0].device == CPU and args[1].device != CPU
        if func is _aten._to_copy.default:
            dev = kwargs.get("device")
            return bool(kwargs.get("non_blocking", False)) and dev is not None and torch.device(dev) == CPU \
                and args[0].device != CPU
        return False


def _check_stream_order(g: Guard, func, args, kwargs) -> None:  # noqa: ANN001
    """An op on the compute stream touching a device tensor a side stream's copy wrote, before a
    ``wait_event`` / ``wait_stream`` ordered that copy first: on a GPU it may run before the copy."""
    for t in _tensors((args, kwargs)):
        if t.device != CPU and _storage(t) in g.on_side:
            raise StreamOrderError(f"{func} on the compute stream uses a device tensor a side stream's copy "
                                   f"wrote, before waiting for that stream (at {g.library_line()})")


def _check_generator(func, args, kwargs) -> None:  # noqa: ANN001
    """A random op's generator on the device of the tensor it fills, as CUDA demands (a CPU
    generator for a CUDA tensor: "Expected a 'cuda' device type for generator")."""
    first = next(_tensors(args), None)
    dev = torch.device(kwargs["device"]) if kwargs.get("device") is not None else first.device
    has = _generator_devices.get(kwargs["generator"]._cdata, CPU)  # the dispatcher hands a new wrapper
    if has.type != dev.type:
        raise RuntimeError(f"{func}: expected a '{dev.type}' device type for generator but found "
                           f"'{has.type}' (all tensors on the same device)")


_generator_devices: dict[int, torch.device] = {}  # C generator address -> the device it reports
_TORCH_GENERATOR = torch.Generator  # the class, kept: the guard serves torch.Generator


class _Generator(torch.Generator):
    """``torch.Generator(device=...)`` under the guard: a CPU generator that reports the device asked
    for (the CPU build makes none for ``lazy``), so random ops check their generator's device."""

    def __new__(cls, device: torch.device | str | int = "cpu") -> _Generator:
        self = _TORCH_GENERATOR.__new__(cls, "cpu")
        self.asked = torch.device(device)
        _generator_devices[self._cdata] = self.asked
        return self

    @property
    def device(self) -> torch.device:
        return self.asked


_ids = itertools.count(1)
_storage_ids: dict[int, int] = {}  # StorageImpl address -> id (a freed address reused keeps its id: harmless)


def _fake_data_ptr(self: torch.Tensor) -> int:
    """A distinct address per fake storage (fake storages all report 0): identity checks such as
    ``p.grad.data_ptr() != view.data_ptr()`` take the branch a real device takes."""
    sid = _storage_ids.setdefault(self.untyped_storage()._cdata, next(_ids))
    return (sid << 40) + self.storage_offset() * self.element_size()


_TENSOR_DATA = torch._C.TensorBase.data  # the C getset: .data read and written


def _get_data(self: torch.Tensor) -> torch.Tensor:
    return _TENSOR_DATA.__get__(self)


def _set_data(self: torch.Tensor, new: torch.Tensor) -> None:
    """``p.data = t`` on a fake tensor: the C impl takes ``t``'s, and the fake device (a Python
    attribute the C setter does not know) follows, as a real tensor's device follows its data."""
    _TENSOR_DATA.__set__(self, new)
    if isinstance(new, FakeTensor):
        self.fake_device = new.fake_device


def _fake_storage_ptr(self: torch.UntypedStorage) -> int:
    """A fake tensor's storage is a meta storage (address 0 for all): a distinct address per storage,
    so buffer pools keyed by address (``zero/gather_pool.py``) tell their buffers apart."""
    if self.device.type != "meta":
        return _REAL_STORAGE_PTR(self)
    return _storage_ids.setdefault(self._cdata, next(_ids)) << 40


_REAL_STORAGE_PTR = torch.UntypedStorage.data_ptr


def _fake_numpy(self: torch.Tensor, *, force: bool = False):  # noqa: ANN202, ARG001
    """``.numpy()`` of a fake tensor (a checkpoint writer's bytes): zeros of its shape for a CPU tensor;
    a device tensor is refused as CUDA refuses it (the bytes must be copied to the host first)."""
    if self.device != CPU:
        raise TypeError(f"can't convert {self.device} device type tensor to numpy: copy the tensor to host memory "
                        "first (expected all tensors to be on the same device)")
    with unset_fake_temporarily():
        return torch.zeros(self.shape, dtype=self.dtype).numpy()


def _guarded_read_into(fd: int, pos: int, dst: torch.Tensor, what: str) -> None:  # noqa: ARG001
    """``safetensors_io.read_into`` under the guard: file bytes go only into a CPU tensor (a device
    tensor here would be a pread into device memory); fake tensors have no bytes to fill."""
    if dst.device != CPU:
        raise RuntimeError(f"{what}: file bytes read into a {dst.device} tensor (expected all tensors to be on "
                           "the same device: a pread fills host memory only)")


@contextlib.contextmanager
def fake_world(world: int = 2, rank: int = 0) -> Iterator[None]:
    """torch's fake process group: collectives accepted, nothing sent, ``world`` ranks in one process
    (this one being ``rank``: a pipeline's later stage is a rank other than 0)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    set_aside = _set_aside_world_of_one()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
        if set_aside is not None:  # the next test finds a world of one up, as it would have; an
            # in-process store: no port held, no environment changed (children inherit it)
            dist.init_process_group(set_aside, store=dist.HashStore(), rank=0, world_size=1)


def _set_aside_world_of_one() -> str | None:
    """The whole suite runs in one pytest process, where earlier tests' ``initialize`` calls leave a
    plain world of one up (gloo); there can be one default group only, so it is destroyed for the
    fake world and its backend returned to bring it back after. A larger world is never ours: refused."""
    if not dist.is_initialized():
        return None
    backend = dist.get_backend()
    if dist.get_world_size() != 1:
        raise RuntimeError(f"a process group ({backend}, world {dist.get_world_size()}) is up in this "
                           "process; the device guard needs its own fake one")
    dist.destroy_process_group()
    return backend


# modules that import compute_device by name (grep "import.*compute_device" shardwise/); a module
# added later is still patched if something imported it before the guard starts
_BINDS_COMPUTE_DEVICE = ("shardwise.fsdp.module", "shardwise.optim.grad_norm", "shardwise.engine.compat",
                         "shardwise.zero.stage3.gathered", "shardwise.inference.stream",
                         "shardwise.sequence_parallel.attention", "shardwise.inference.tensor_parallel")


@contextlib.contextmanager
def device_guard(device: torch.device = DEVICE) -> Iterator[Guard]:
    """Run the block with the library computing on ``device`` (fake tensors, devices checked)."""
    import shardwise.comm.core as core

    for name in _BINDS_COMPUTE_DEVICE:  # the package imports lazily: bind before patching
        importlib.import_module(name)
    guard = Guard()
    saved: list[tuple[object, str, object]] = []

    def patch(obj: object, name: str, value: object) -> None:
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    original = core.compute_device
    for mod in [m for name, m in list(sys.modules.items()) if name.startswith("shardwise") and m is not None]:
        if getattr(mod, "compute_device", None) is original:
            patch(mod, "compute_device", lambda: device)
    for obj, name, value in stream_patches(guard, device):
        patch(obj, name, value)
    import shardwise.zero.host_copy as host_copy

    patch(host_copy, "_SIDE_STREAMS", {})  # side streams made under this guard only (they report to it)
    patch(torch, "Generator", _Generator)
    patch(FakeTensor, "data_ptr", _fake_data_ptr)
    patch(FakeTensor, "numpy", _fake_numpy)
    patch(torch.UntypedStorage, "data_ptr", _fake_storage_ptr)
    FakeTensor.data = property(_get_data, _set_data)  # FakeTensor has none of its own: removed after
    import shardwise.files.safetensors_io as sio

    for mod in [m for name, m in list(sys.modules.items()) if name.startswith("shardwise") and m is not None]:
        if getattr(mod, "read_into", None) is sio.read_into:
            patch(mod, "read_into", _guarded_read_into)
    try:
        with _GuardMode(guard):
            yield guard
    finally:
        del FakeTensor.data
        _generator_devices.clear()
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


@contextlib.contextmanager
def cuda_reported() -> Iterator[None]:
    """``torch.cuda.is_available()`` answers True in the block, so the library's branches that pin
    host memory run (fake tensors are never pinned: the branch is reached, pinning is not modelled).
    Move the model to the device before it: torch's own ``Module.to`` then takes a CUDA-only path."""
    saved = torch.cuda.is_available
    torch.cuda.is_available = lambda: True
    try:
        yield
    finally:
        torch.cuda.is_available = saved
