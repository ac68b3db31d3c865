"""zero.Init ``from_pretrained`` of MoE folders that ``save_pretrained`` wrote (the hub's per-expert
layout: ``experts.N.w1/w2/w3`` for Mixtral, ``experts.N.gate/up/down_proj`` for Qwen3-MoE) while the
model holds 3-D ``gate_up_proj`` / ``down_proj``: the deferred reader serves the 3-D tensors from the
per-expert ones by transformers' conversion mapping (shardwise/sharded_init/hub_names.py). The values are
copied, never computed, so they must equal plain ``from_pretrained`` bit for bit."""

from __future__ import annotations

import moe_cases
import pytest
import torch


@pytest.mark.parametrize(("kind", "ep", "facade"), [("mixtral", 2, False), ("qwen3_moe", 1, True),
                                                    ("qwen3_moe", 2, False)])
def test_zero_init_reads_the_per_expert_layout(pool2, tmp_path, kind, ep, facade):
    res = pool2.run("moe_hub_cases:zero_init_hub", kind, str(tmp_path / kind), ep, facade)
    for r in res:
        assert r["was_deferred"] and r["names_equal"], r
        assert r["unequal"] == [], r  # gathered at ZeRO-3 (experts over the EP group) == plain from_pretrained
        assert torch.isfinite(torch.tensor(r["loss"]))


def test_mixtral_without_ep_and_a_missing_expert_tensor_refused_in_one_line(pool2, tmp_path):
    res = pool2.run("moe_hub_cases:zero_init_hub", "mixtral", str(tmp_path / "ok"), 1)
    assert all(r["unequal"] == [] and r["names_equal"] for r in res), res
    for msg in pool2.run("moe_hub_cases:missing_tensor", str(tmp_path / "broken")):
        assert msg.startswith(f"UserError: {tmp_path / 'broken'}: cannot read the model's tensor "
                              "'model.layers.1.mlp.experts.gate_up_proj': expert 2's tensor matching "
                              "'.experts.*.w3.weight' is not stored"), msg
        assert "\n" not in msg


def test_an_ep_rank_reads_only_its_experts_rows(tmp_path):
    """The rows of experts 2..3 of a per-expert folder: exactly their stored bytes are read, and
    they equal plain from_pretrained's rows."""
    from transformers import AutoModelForCausalLM

    from shardwise.sharded_init.context import SafetensorsSource

    moe_cases.build("qwen3_moe").save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    src = SafetensorsSource(tmp_path, plain)
    for name in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        p = dict(plain.named_parameters())[name]
        per = p[0].numel()
        before = src.bytes_read
        rows = src.read(name, p.shape, 2 * per, 4 * per, [])
        assert torch.equal(rows.view(2, *p.shape[1:]), p.detach()[2:4])
        assert src.bytes_read - before == 2 * per * 4
        odd = src.read(name, p.shape, per - 5, 2 * per + 7, [])  # across experts and gate/up
        assert torch.equal(odd, p.detach().reshape(-1)[per - 5:2 * per + 7])


def test_a_base_model_folder_reads_into_the_causal_lm_and_a_missing_tensor_is_named(tmp_path):
    """``save_pretrained`` of the base model (no ``model.`` prefix, per-expert Mixtral names) serves
    every parameter of the causal LM by transformers' prefix rule; ``lm_head``, stored under no
    name, is refused in one line naming the folder and the tensor."""
    from shardwise.errors import UserError
    from shardwise.sharded_init.context import SafetensorsSource

    model = moe_cases.build("mixtral")
    model.model.save_pretrained(tmp_path)
    src = SafetensorsSource(tmp_path, model)
    for name, p in model.named_parameters():
        if name != "lm_head.weight":
            assert torch.equal(src.read(name, p.shape, 0, p.numel(), []).view(p.shape), p.detach()), name
    with pytest.raises(UserError, match=rf"^{tmp_path}: the model's tensor 'lm_head.weight' is not in the checkpoint"):
        src.read("lm_head.weight", model.lm_head.weight.shape, 0, 8, [])
