"""The rank pools (tests/rank_pool.py): every case starts clean, and a bad case stays its own test's.

Issue 48: multi-rank tests share long-lived ranks, so nothing one case leaves behind (environment,
working folder, temp files, torch's default dtype and grad mode, RNG state) may reach the next, and
a case that hangs or fails on some ranks must fail within its timeout and leave a working pool.
"""

from __future__ import annotations

import pytest
from rank_pool import RankError, RankPool

CASES = "rank_pool_cases"


def test_each_case_starts_clean_whatever_the_last_one_left(pool2: RankPool, tmp_path) -> None:
    first = pool2.run(f"{CASES}:leave_marks", str(tmp_path))
    second = pool2.run(f"{CASES}:leave_marks", str(tmp_path))
    for before, after in zip(first, second, strict=True):
        assert after["env"] is None and after["cwd"] == before["cwd"] != str(tmp_path)
        assert after["dtype"] == "torch.float32" and after["grad"] is True and after["sigterm"]
        assert after["tmp"] != before["tmp"]  # a temp folder of the case's own, removed after it
        assert after["draws"] == before["draws"]  # seeded the same before every case
    assert first[0]["draws"] == first[1]["draws"]
    assert pool2.run(f"{CASES}:all_reduce_sum") == [3.0, 3.0]


def test_a_session_pool_freezes_only_what_its_ranks_held_when_they_joined(pool2: RankPool) -> None:
    """The session pools' ranks leave their imports out of the collector's walks (a CPU saving); what a case
    makes is still listed by gc.get_objects() and freed when it is a dropped cycle."""
    for r in pool2.run(f"{CASES}:garbage_collected"):
        assert r["frozen"] > 100_000 and r["cycle_freed"] and r["listed"], r


@pytest.mark.subprocess  # its subject is the ranks themselves: killed and started again
def test_a_hang_or_a_one_rank_failure_fails_that_case_and_the_next_runs() -> None:
    pool = RankPool(2, timeout_s=30)
    try:
        pids = pool.run(f"{CASES}:rank_and_pid")
        with pytest.raises(RankError, match=r"no answer within 2s from ranks \[1\]"):
            pool.run(f"{CASES}:hang_on_rank1", 60, timeout=2)
        after_hang = pool.run(f"{CASES}:rank_and_pid")  # not rank 1's late answer to the hung case
        assert [r for r, _ in after_hang] == [0, 1] and set(after_hang).isdisjoint(pids)
        assert pool.run(f"{CASES}:all_reduce_sum") == [3.0, 3.0]
        with pytest.raises(RankError, match="rank 0 fails alone"):
            pool.run(f"{CASES}:fail_on_rank0")
        assert set(pool.run(f"{CASES}:rank_and_pid")).isdisjoint(after_hang)  # restarted: ranks disagreed
        kept = pool.run(f"{CASES}:rank_and_pid")
        with pytest.raises(RankError, match="every rank fails the same way"):
            pool.run(f"{CASES}:fail_everywhere")
        assert pool.run(f"{CASES}:rank_and_pid") == kept  # a failure every rank shared keeps the ranks
        assert pool.run(f"{CASES}:all_reduce_sum") == [3.0, 3.0]
        # not a session pool (as run_fresh's): a heap like a new process's, nothing frozen
        assert [r["frozen"] for r in pool.run(f"{CASES}:garbage_collected")] == [0, 0]
    finally:
        pool.close()
