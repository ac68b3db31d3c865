"""Expert parallelism (shardwise.moe): dispatch / combine, layouts, EP x ZeRO against one process."""

from __future__ import annotations

import pytest


# -- dispatch / combine (Megatron's dispatcher test) --------------------------------------
@pytest.mark.parametrize("experts,tokens,top_k", [(4, 7, 2), (8, 13, 3), (2, 5, 1)])
def test_dispatch_then_combine_restores_input_and_gradient(pool2, experts, tokens, top_k):
    for r in pool2.run("moe_cases:roundtrip", experts, tokens, top_k):
        assert r["rows"] == r["expected_rows"]
        assert r["equal"], r["max_err"]
        assert r["grad_equal"]


def test_a_rank_receiving_nothing_does_not_hang(pool2):
    # every token on both ranks goes to expert 1 (rank 0's): rank 1 receives no row
    res = pool2.run("moe_cases:roundtrip", 4, 5, 1, only_expert=1)
    assert res[1]["rows"] == 0 and res[0]["rows"] == 10
    assert all(r["equal"] and r["grad_equal"] for r in res)


def test_a_rank_with_no_tokens_does_not_hang(pool2):
    for tokens in ([0, 0], [6, 0]):  # rank 1 routes nothing (an empty micro-batch)
        res = pool2.run("moe_cases:roundtrip", 4, tokens, 2)
        assert all(r["equal"] and r["grad_equal"] and r["rows"] == r["expected_rows"] for r in res)


@pytest.mark.parametrize("experts", [4, 8])
def test_rows_arrive_grouped_by_local_expert(pool2, experts):
    assert all(r["grouped"] for r in pool2.run("moe_cases:sorted_rows", experts))
