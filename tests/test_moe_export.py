"""Expert parallelism's exports (``state_dict()``, ``save_pretrained``) and zero.Init models.

Under EP a rank holds E/EP experts; every export must still give the full experts under their HF
names (docs/moe.md, "State dicts"). Compared bit for bit with the unsplit model's tensors and the
engine's own full weights (both gather the same fp32 values: nothing is recomputed), and a model
built under ``zero.Init`` trains the numbers of the model built whole (tests/test_moe.py's bound).
"""

from __future__ import annotations

import moe_cases
import pytest
import torch
from test_moe import _check, _reference
from tolerance import EPS32


@pytest.mark.parametrize("stage", [2, 3])
def test_state_dict_and_save_pretrained_give_the_full_experts(pool2, tmp_path, stage):
    from transformers import AutoModelForCausalLM

    res = pool2.run("moe_export_cases:state_dict_under_ep", stage, str(tmp_path / "hf"))
    for r in res:
        assert r["before_equal"] and r["after_equal"], r  # the unsplit model's tensors; the engine's full weights
        assert r["expert_shape"] == [4, 96, 32]
        assert r.get("reloaded_equal", True) and r["copy_equal"]
    if stage == 2:  # rank 1 alone: refused in one line after the join timeout, not a hang
        assert res[0]["alone"] == "rank 0 did not call it"
        assert "state_dict() under expert parallelism is collective" in res[1]["alone"], res[1]["alone"]
        assert "\n" not in res[1]["alone"]
    live = res[0]["live"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32, attn_implementation="eager")
    assert model.config._experts_implementation != "shardwise_ep"
    got = dict(model.named_parameters())
    assert got.keys() == live.keys()
    for n, p in got.items():
        assert torch.equal(p.detach(), live[n]), n
    ref = moe_cases.build("mixtral")
    ref.load_state_dict(live)
    ids = moe_cases.batches(1, 1, 2)[0, 0]
    torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=4 * EPS32, atol=0)


def test_a_zero_init_model_trains_under_ep_as_the_model_built_whole(pool2, tmp_path):
    """`from_pretrained` inside `zero.Init` (a folder in the 3-D layout): each rank reads its experts'
    rows; ZeRO-3 x EP 2 then trains the single-process numbers."""
    res = pool2.run("moe_export_cases:zero_init_train", str(tmp_path / "src"))
    assert all(r["was_deferred"] for r in res)
    _check(res, _reference("mixtral", 2), 2, 2, 3)


def test_a_zero_init_from_config_model_gets_its_experts_from_the_models_init(pool2):
    res = pool2.run("moe_export_cases:zero_init_from_config")
    for r in res:
        assert r["was_deferred"] and r["shape"] == [4, 96, 32] and r["halves_differ"]
        assert r["std"] == pytest.approx(r["init_range"], rel=0.1)  # normal(0, initializer_range), 12k draws
        assert torch.isfinite(torch.tensor(r["loss"]))
    assert res[0]["loss"] != res[1]["loss"]  # each rank its own part of the batch, same model


def test_a_deep_copy_of_a_split_model_trains_as_the_split_model(pool2):
    res = pool2.run("moe_export_cases:deep_copy_trains", 2)
    _check(res, _reference("mixtral", 2), 2, 2, 2)
