"""What SP keeps per rank: the activations saved for backward are at most 1/N of the no-SP run's.

Counted, not timed: the bytes of the storages autograd saves in one forward and still holds at its end
(deterministic). Ulysses used to keep each layer's attention output twice (head-sharded for sdpa's
backward, sequence-sharded for o_proj's) and, with fewer kv heads than ranks, a whole kv head per rank;
both are above 1/N: the sdpa cases failed by 16 and 24 KiB per rank (of 170 KiB) before
shardwise/sequence_parallel/saved_once.py, which leaves 1020 bytes under (scalars). Eager's
``[h, s, s]`` attention weights halve under SP too, so it passed even then: kept as the other wrapped kernel."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("impl,kv_heads", [("sdpa", 2), ("sdpa", 1), ("eager", 2)])
def test_sp2_saves_at_most_half_of_the_whole_sequence(pool2, impl, kv_heads):
    for r in pool2.run("sp_memory_cases:saved_bytes_whole_and_split", impl, kv_heads, 32):
        assert r["split"] * r["sp"] <= r["whole"], r
