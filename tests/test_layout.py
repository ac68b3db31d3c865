"""FlatLayout: the one owner of "which piece of which parameter lies in this shard"."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.zero.layout import FlatLayout


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=8), st.integers(1, 7))
def test_shard_segments_match_chunking_the_flat_buffer(numels: list[int], world: int) -> None:
    """Every rank's segments, read from the parameters, equal torch.chunk of the padded buffer."""
    layout = FlatLayout(tuple(numels), world)
    params = [torch.arange(n, dtype=torch.float64) + 1000 * i for i, n in enumerate(numels)]
    flat = torch.zeros(layout.padded_numel, dtype=torch.float64)
    torch.cat(params, out=flat[: layout.numel])
    assert layout.padded_numel % world == 0 and layout.padded_numel - layout.numel < world
    covered = [0] * len(numels)
    for rank, chunk in enumerate(flat.chunk(world)):
        start, n = layout.shard_range(rank)
        assert n == chunk.numel() == layout.shard_numel
        got = torch.zeros(n, dtype=torch.float64)
        for seg in layout.shard_segments(rank):
            got[seg.offset : seg.offset + seg.length] = params[seg.index][seg.start : seg.stop]
            assert seg.length > 0 and layout.segment_of(seg.index, start, n) == seg
            covered[seg.index] += seg.length
        torch.testing.assert_close(got, chunk, rtol=0, atol=0)
    assert covered == numels  # the shards tile every parameter exactly once
