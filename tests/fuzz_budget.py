"""How much the fuzz tests fuzz, and the memory bound every example keeps (helpers, not tests).

- In the suite each fuzz test runs its stated number of examples, derandomized (the same examples
  every run: the suite is deterministic). ``SHARDWISE_FUZZ_EXAMPLES=N`` scales every count by N/100.
- ``SHARDWISE_FUZZ=long`` multiplies the counts by ``LONG_FACTOR`` (thousands per file) and draws
  fresh random examples each run (``derandomize`` off), so repeated long runs explore new ground.
- :func:`memory_bound`: the peak resident memory of the process during one example may grow at most
  ``limit`` bytes above its resident memory at the start of the example (Linux ``VmHWM`` reset per
  example through ``/proc/self/clear_refs``; where that is not writable the bound is not checked).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from foreign_gen import reset_hwm, vm_hwm, vm_rss
from hypothesis import HealthCheck, Phase, settings

LONG = os.environ.get("SHARDWISE_FUZZ", "").lower() == "long"
LONG_FACTOR = 20
SCALE = int(os.environ.get("SHARDWISE_FUZZ_EXAMPLES", 100)) / 100 * (LONG_FACTOR if LONG else 1)
EXAMPLE_MEMORY = 256 << 20  # a checkpoint or config of a few KiB to a few MiB: far below; a runaway: far above


def examples(n: int) -> int:
    """``n`` examples in the suite, scaled (``SHARDWISE_FUZZ_EXAMPLES``, ``SHARDWISE_FUZZ=long``)."""
    return max(1, int(n * SCALE))


def fuzz_settings(n: int, shrink: bool = True, function_fixtures: bool = False) -> settings:
    """hypothesis settings for a fuzz test of ``n`` suite examples (no deadline: the host is shared)."""
    checks = [HealthCheck.too_slow] + ([HealthCheck.function_scoped_fixture] if function_fixtures else [])
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if shrink else [])
    return settings(max_examples=examples(n), deadline=None, derandomize=not LONG and SCALE <= 1,
                    suppress_health_check=checks, phases=phases, database=None)


@contextmanager
def memory_bound(limit: int = EXAMPLE_MEMORY, what: str = "one example") -> Iterator[None]:
    """Fail when the peak RSS during the block grows more than ``limit`` bytes above its start.

    No ``gc.collect()`` first: with transformers loaded it costs up to a second, and garbage left
    from the previous example only raises the start the growth is measured from. ~2 ms per example."""
    measured = reset_hwm()
    base = vm_rss()
    yield
    if measured:
        grew = vm_hwm() - base
        assert grew <= limit, f"{what}: peak RSS grew {grew >> 20} MiB (bound {limit >> 20} MiB)"
