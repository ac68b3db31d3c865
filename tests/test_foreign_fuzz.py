"""Property test of the foreign checkpoint readers (DeepSpeed ``.pt``, DCP ``.metadata``).

Each example writes a synthetic checkpoint (``foreign_gen.py``: DeepSpeed stages 1-3 at world 1-3,
or a DCP folder with chunked tensors) with random parameter shapes, and damages it: tensors stored
with another size, stride (0 included) or storage offset, a tensor referenced several times
(shared references), a chain of lists each holding the next one twice (2**k paths through k
objects), claimed sizes up to 2**40 elements, chunks and byte ranges moved, two items sharing
bytes, a NaN Adam step, a non-integer ``global_steps``. Allowed outcomes only:

- success, with every master (DeepSpeed) or tensor (DCP) equal to what the files really hold, as
  computed independently from the written values by the format's layout rules; an honest
  checkpoint must succeed;
- a ``CheckpointError`` of one line naming a file of the folder.

In both cases the process's peak resident memory grows by at most ``MEM_FACTOR`` times the bytes
of the checkpoint's files plus ``MEM_SLACK`` (measured with ``VmHWM``, reset before each read), and
each example ends in seconds (an alarm fails it): no claimed size is allocated before the file's
bytes back it, and no walk is exponential. Bounded and derandomized (tests/fuzz_budget.py:
``SHARDWISE_FUZZ_EXAMPLES`` scales it, ``SHARDWISE_FUZZ=long`` runs thousands).
"""

from __future__ import annotations

import gc
import math
import signal
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch
from foreign_gen import (
    DcpDamage,
    DsDamage,
    expected_dcp,
    expected_deepspeed,
    reset_hwm,
    vm_hwm,
    vm_rss,
    write_dcp,
    write_deepspeed,
)
from fuzz_budget import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from shardwise.checkpoint import CheckpointError
from shardwise.checkpoint.formats import open_checkpoint

MEM_FACTOR, MEM_SLACK = 4, 48 << 20  # docs/reliability.md states the same bound
OUTCOMES: Counter = Counter()
HUGE = [2**20, 2**28, 2**30, 2**36, 2**40]


def _fuzz(n: int):  # 60 in the suite: ~0.5 s an example on a loaded host, the dearest of the fuzzers
    return fuzz_settings(n, shrink=False)


@pytest.fixture(scope="module", autouse=True)
def _needs_hwm():
    if not reset_hwm():
        pytest.skip("/proc/self/clear_refs is not writable: peak memory cannot be measured here")
    # Each example collects the previous one's garbage before measuring (`_read`); with transformers and
    # the suite's earlier tests loaded a full collection walks millions of objects (0.2-0.4 s, most of an
    # example's time). Frozen, what exists now is skipped by every collection; unfrozen after the module.
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()
    print("\nforeign fuzz outcomes:", dict(sorted(OUTCOMES.items())))


def _alarm(signum, frame):
    raise TimeoutError("a foreign checkpoint read took more than 60 s")


def _read(folder: Path) -> tuple[dict | None, str | None, int]:
    """(tensors by saved key, or None; the error; peak RSS growth in bytes) of reading ``folder``."""
    gc.collect()
    reset_hwm()
    base = vm_rss()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(60)
    try:
        meta, reader = open_checkpoint(folder)
        got = dict(reader.tensors)
        err = None
    except CheckpointError as e:
        got, err = None, str(e)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return got, err, vm_hwm() - base


def _check_memory(folder: Path, grew: int) -> None:
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    assert grew <= MEM_FACTOR * size + MEM_SLACK, f"peak RSS grew {grew >> 20} MiB for {size} bytes of files"


def _check_error(err: str, folder: Path) -> None:
    assert "\n" not in err, err
    assert str(folder) in err, err


SHAPE = st.lists(st.integers(1, 40), min_size=1, max_size=3)
VIEW = st.tuples(st.integers(-8, 8), st.integers(0, 8), st.sampled_from([0, 1, 1, 2]),
                 st.one_of(st.just(-1), st.just(-1), st.integers(0, 300), st.sampled_from(HUGE)))


@st.composite
def deepspeed_cases(draw):
    stage = draw(st.sampled_from([1, 2, 3]))
    world = draw(st.integers(1, 3))
    ngroups = 1 if stage == 3 else draw(st.integers(1, 2))
    shapes = [{f"g{g}.p{i}": draw(SHAPE) for i in range(draw(st.integers(1, 3)))} for g in range(ngroups)]
    d = DsDamage()
    kind = draw(st.sampled_from(["none", "view", "repeat", "shape", "step", "global_steps", "dag", "alias", "mix"]))
    if kind == "alias" and ngroups > 1:
        d.alias = True
        shapes = [{f"g{g}.p{i}": s for i, s in enumerate(shapes[0].values())} for g in range(ngroups)]
    if kind in ("view", "mix"):
        for _ in range(draw(st.integers(1, 2))):
            d.view[(draw(st.integers(0, world - 1)), draw(st.integers(0, ngroups - 1)))] = draw(VIEW)
    if kind in ("repeat", "mix"):
        d.repeat = draw(st.sampled_from([1, 2, 50]))
    if kind == "shape":
        name = draw(st.sampled_from(sorted(n for g in shapes for n in g)))
        d.shape = (name, draw(st.one_of(SHAPE, st.lists(st.sampled_from(HUGE), min_size=1, max_size=3))))
    if kind == "step":
        d.step = draw(st.sampled_from([math.nan, math.inf, -math.inf, 7.0]))
    if kind == "global_steps":
        d.global_steps = draw(st.sampled_from([2.5, "3", -1, None, True, 2**70, 5]))
    if kind in ("dag", "mix"):
        d.dag = draw(st.sampled_from([10, 40]))
    return stage, world, shapes, d, draw(st.integers(0, 99))


@_fuzz(60)
@given(deepspeed_cases())
def test_fuzz_deepspeed_reader(case):
    stage, world, shapes, damage, seed = case
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "global_step2"
        want = write_deepspeed(folder, shapes, world, stage, seed, damage)
        expect = expected_deepspeed(shapes, world, stage, damage, want)
        del want
        got, err, grew = _read(folder)
        OUTCOMES["deepspeed", "ok" if got is not None else "refused", damage.honest()] += 1
        _check_memory(folder, grew)
        if got is None:
            _check_error(err, folder)
            assert not damage.honest(), err
            return
        assert expect is not None, "an inconsistent DeepSpeed checkpoint was read"
        assert set(expect) == {k.removeprefix("master/") for k in got if k.startswith("master/")}
        for name, t in expect.items():
            assert torch.equal(got[f"master/{name}"], t.reshape(-1)), name


@st.composite
def dcp_cases(draw):
    count = draw(st.integers(1, 3))
    sizes = {f"t{i}": draw(st.lists(st.integers(1, 30), min_size=1, max_size=2)) for i in range(count)}
    parts = draw(st.integers(1, 3))
    names = sorted(sizes)
    d = DcpDamage()
    kind = draw(st.sampled_from(["none", "size", "chunk", "storage", "share", "view", "dag"]))
    name = draw(st.sampled_from(names))
    if kind == "size":
        d.size = (name, draw(st.one_of(st.lists(st.integers(0, 40), min_size=1, max_size=3),
                                       st.lists(st.sampled_from(HUGE), min_size=1, max_size=3))))
    elif kind == "chunk":
        dims = len(sizes[name])
        d.chunk = (name, draw(st.integers(0, 2)), draw(st.lists(st.integers(0, 40), min_size=dims, max_size=dims)),
                   draw(st.lists(st.one_of(st.integers(0, 40), st.sampled_from(HUGE)), min_size=dims, max_size=dims)))
    elif kind == "storage":
        d.storage = (name, draw(st.integers(0, 2)), draw(st.integers(-2000, 2000)),
                     draw(st.one_of(st.just(-1), st.integers(0, 5000), st.sampled_from(HUGE))))
    elif kind == "share" and len(names) > 1:
        a, b = draw(st.permutations(names))[:2]
        d.share = (a, b)
    elif kind == "view":
        one_d = [n for n in names if len(sizes[n]) == 1]
        if one_d:
            d.view = (draw(st.sampled_from(one_d)), draw(VIEW))
    elif kind == "dag":
        d.dag = draw(st.sampled_from([10, 40]))
    return sizes, parts, d, draw(st.integers(0, 99))


@_fuzz(60)
@given(dcp_cases())
def test_fuzz_dcp_reader(case):
    sizes, parts, damage, seed = case
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "dcp"
        want = write_dcp(folder, sizes, parts, seed, damage)
        expect = expected_dcp(want, parts, damage)
        got, err, grew = _read(folder)
        OUTCOMES["dcp", "ok" if got is not None else "refused", damage.honest()] += 1
        _check_memory(folder, grew)
        if got is None:
            _check_error(err, folder)
            assert not damage.honest(), err
            return
        assert expect is not None, f"an inconsistent DCP checkpoint was read ({damage})"
        for name, t in expect.items():
            assert torch.equal(got[f"master/{name}"], t.reshape(-1)), name
