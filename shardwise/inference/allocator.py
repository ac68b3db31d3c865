"""Pin glibc malloc's thresholds while layers stream, so freed memory goes back at once.

Why: glibc raises its mmap threshold to the size of the largest block freed so far (up to
32 MiB) and its trim threshold to twice that. After one embedding-sized free (a 24 MiB tensor
dropped while a model loads), every later allocation under 32 MiB (activations, KV-cache growth)
comes from the heap, and up to 64 MiB of freed heap per thread arena stays resident. How much of
that is held at the peak depends on how the main and reader threads happen to interleave: on a
busy 2-core machine the same streamed generation peaked at 20-24% of a 695 MiB model above its
baseline, 17.6% once the thresholds were pinned (stop 31, ``docs/inference.md``).

Setting ``M_MMAP_THRESHOLD`` explicitly turns the dynamic adjustment off: blocks of at least
``mmap_threshold`` bytes are always mapped and unmapped when freed, and a heap keeps at most
``trim_threshold`` bytes free at its top. The slack the allocator may hold is then a constant
(:func:`allocator_slack`), which the streamed-memory bound (``inference.bound``) counts.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers (malloc.h)
MMAP_THRESHOLD = 4 << 20  # a decode step's tensors stay below it; layers and large prefills are mapped
TRIM_THRESHOLD = 8 << 20
ARENAS = 2  # the threads that allocate while streaming: the main thread and the reader thread

_pinned: dict[str, int] = {}


def pin_allocator(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> dict[str, int]:
    """Pin the thresholds (glibc only; elsewhere, or with ``SHARDWISE_PIN_MALLOC=0``, nothing is
    changed and ``{}`` is returned). Returns the settings in force. Idempotent."""
    if _pinned or os.environ.get("SHARDWISE_PIN_MALLOC", "1") == "0":
        return dict(_pinned)
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return {}
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not (libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold) and libc.mallopt(M_TRIM_THRESHOLD, trim_threshold)):
        return {}
    libc.malloc_trim(0)  # give back what the heap already holds beyond the new threshold
    _pinned.update(mmap_threshold=mmap_threshold, trim_threshold=trim_threshold)
    return dict(_pinned)


def allocator_slack() -> int:
    """Bytes the allocator may keep free but resident once pinned (each arena's heap top); 0 when
    not pinned (the bound then does not hold by construction and says so)."""
    return ARENAS * _pinned["trim_threshold"] if _pinned else 0


def is_pinned() -> bool:
    return bool(_pinned)
