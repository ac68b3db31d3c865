"""The stage >= 2 gradient-bucket pool of ``InflightLimit`` (zero/pending.py), without ranks.

It hands a finished bucket to the next one instead of a fresh allocation (a fresh ``mmap`` and its
page faults per bucket per backward on the CPU), keeps at most ``limit + 1`` buckets in all, picks
the smallest free one that fits, and pools CPU buckets only.
"""

from __future__ import annotations

import torch

from shardwise.zero.pending import InflightLimit

CPU = torch.device("cpu")


def test_a_given_bucket_is_taken_again_smallest_fit_first() -> None:
    pool = InflightLimit(limit=2)
    big, small = pool.take_bucket(100, torch.float32, CPU), pool.take_bucket(40, torch.float32, CPU)
    pool.give_bucket(big)
    pool.give_bucket(small)  # two sizes in the free list: taking must not compare tensor values
    assert pool.take_bucket(30, torch.float32, CPU) is small
    assert pool.take_bucket(90, torch.float32, CPU) is big
    fresh = pool.take_bucket(120, torch.float32, CPU)  # nothing free fits
    assert fresh is not big and fresh is not small and fresh.numel() == 120


def test_dtype_must_match_and_at_most_limit_plus_one_buckets_exist() -> None:
    pool = InflightLimit(limit=2)
    buckets = [pool.take_bucket(10, torch.float32, CPU) for _ in range(5)]
    for b in buckets:
        pool.give_bucket(b)
    assert len(pool._free) == 3  # limit + 1, though five were given back
    assert pool.take_bucket(10, torch.bfloat16, CPU).dtype == torch.bfloat16  # not a float32 one
    kept = {id(b) for b in pool._free}
    assert id(pool.take_bucket(10, torch.float32, CPU)) in kept


def test_buckets_off_the_cpu_are_not_pooled() -> None:
    pool = InflightLimit(limit=2)
    pool.give_bucket(torch.empty(10, device="meta"))  # CUDA's caching allocator already reuses blocks
    assert pool._free == []


def test_settle_waits_every_queued_reduction_and_keeps_no_bucket() -> None:
    """Stage 3's end of backward: every admitted group is waited for, once, and no bucket is kept."""

    class Group:
        def __init__(self, pool: InflightLimit) -> None:
            self.pool, self.waits = pool, 0
            self.bucket = pool.take_bucket(10, torch.float32, CPU)

        def wait(self) -> None:  # what ShardedGroup.wait does: the finished bucket goes back
            self.waits += 1
            if self.bucket is not None:
                self.pool.give_bucket(self.bucket)
                self.bucket = None

    pool = InflightLimit(limit=2)
    groups = [Group(pool) for _ in range(2)]
    for g in groups:
        pool.admit(g)  # within the limit: still pending
    assert [g.waits for g in groups] == [0, 0] and pool.in_use == 2
    pool.settle()
    assert [g.waits for g in groups] == [1, 1]
    assert pool.in_use == 0 and pool.free_nbytes == 0
    pool.settle()  # nothing queued: waits no group again
    assert [g.waits for g in groups] == [1, 1]
