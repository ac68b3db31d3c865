"""Tests for the memory/communication estimator: ZeRO paper formulas, exact HF counts, CLI, advice."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from shardwise.cli.estimate import main
from shardwise.estimate import (
    ModelFacts,
    count_params,
    estimate,
    format_report,
    model_facts,
    parse_bytes,
    parse_count,
)

GB = 10**9


def per_device(est, stage):
    return est.stages[stage].per_device_bytes


# ---------------------------------------------------------------- parsing

@pytest.mark.parametrize("text,value", [
    ("1e9", 10**9), ("7.5B", 7_500_000_000), ("350M", 350_000_000), ("1T", 10**12),
    ("124439808", 124_439_808), ("1,000", 1000), ("7.5b", 7_500_000_000), ("2K", 2000), (42, 42),
])
def test_parse_count(text, value):
    assert parse_count(text) == value


@pytest.mark.parametrize("text", ["7X", "", "B", "1.5", "-3", "1e-3", "seven"])
def test_parse_count_rejects(text):
    with pytest.raises(ValueError):
        parse_count(text)


@pytest.mark.parametrize("text,value", [
    ("80GB", 80 * 10**9), ("80GiB", 80 * 2**30), ("24G", 24 * 10**9), ("1.5TB", 1_500_000_000_000),
    ("512MiB", 512 * 2**20), ("80 gb", 80 * 10**9), ("1024", 1024),
])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


def test_parse_bytes_rejects_unknown_unit():
    with pytest.raises(ValueError, match="80GX"):
        parse_bytes("80GX")


# ---------------------------------------------------------------- ZeRO formulas

def test_zero_paper_figure1_numbers():
    """ZeRO paper Figure 1: Ψ = 7.5B, N = 64, K = 12: 120, 31.4, 16.6, 1.9 GB per device."""
    est = estimate(7_500_000_000, 64)
    assert per_device(est, 0) == 120 * GB
    assert round(per_device(est, 1) / GB, 1) == 31.4
    assert round(per_device(est, 2) / GB, 1) == 16.6
    assert round(per_device(est, 3) / GB, 1) == 1.9
    assert per_device(est, 3) == 16 * 7_500_000_000 // 64


@pytest.mark.parametrize("psi", [10**9, 7_500_000_000, 124_439_808 * 64])
@pytest.mark.parametrize("n", [1, 4, 8, 64])
def test_mixed_precision_formulas(psi, n):
    est = estimate(psi, n, dtype="fp16")
    assert per_device(est, 0) == 16 * psi
    assert per_device(est, 1) == 4 * psi + 12 * psi // n
    assert per_device(est, 2) == 2 * psi + 14 * psi // n
    assert per_device(est, 3) == 16 * psi // n
    for st, s in est.stages.items():
        assert s.cluster_bytes == s.per_device_bytes * n
        assert s.saving == pytest.approx(1 - s.per_device_bytes / (16 * psi))
        assert s.comm_elements == (3 if st == 3 else 2) * psi
        assert s.comm_bytes == s.comm_elements * (n - 1) // n * 2


@pytest.mark.parametrize(("dtype", "offload", "master", "resident3"), [
    ("bf16", "none", "fp32", 14), ("fp16", "none", "fp32", 14), ("bf16", "optimizer", "fp32", 4),
    ("bf16", "params", "fp32", 2), ("fp32", "none", "fp32", 16), ("bf16", "none", "states", 10),
])
def test_stage3_resident_figure_beside_the_papers(dtype, offload, master, resident3):
    """The paper's per-device figures stay; shardwise's own (what memory_report() holds in a step) drops the
    16-bit parameter shard at stage 3 only where the fp32 master stays on the device (zero/store.py)."""
    psi, n = 10**9, 8
    est = estimate(psi, n, dtype=dtype, offload=offload, master=master)
    for st, s in est.stages.items():
        if st < 3:
            assert (s.resident_bytes, s.resident_formula) == (s.per_device_bytes, s.formula)
    s3 = est.stages[3]
    assert s3.resident_bytes == resident3 * psi // n
    lean = s3.resident_bytes != s3.per_device_bytes
    assert s3.per_device_bytes == s3.resident_bytes + (2 * psi // n if lean else 0)
    assert lean is (resident3 == 14)
    assert any("Stage 3 in shardwise: 14Ψ/N" in note for note in est.notes) is lean


def test_fp32_formulas_and_components():
    psi, n = 10**9, 8
    est = estimate(psi, n, dtype="fp32")
    assert [c.name for c in est.components] == ["fp32 params", "fp32 grads", "Adam m (fp32)", "Adam v (fp32)"]
    assert sum(c.bytes for c in est.components) == 16 * psi
    assert [est.stages[s].formula for s in range(4)] == ["16Ψ", "8Ψ + 8Ψ/N", "4Ψ + 12Ψ/N", "16Ψ/N"]
    assert per_device(est, 1) == 8 * psi + 8 * psi // n
    assert per_device(est, 2) == 4 * psi + 12 * psi // n
    assert est.stages[0].comm_bytes == 2 * psi * (n - 1) // n * 4


def test_mixed_components_and_stage_formulas():
    est = estimate(10**9, 4, dtype="bf16")
    assert {c.name: c.formula for c in est.components} == {
        "bf16 params": "2Ψ", "fp32 master params": "4Ψ", "bf16 grads": "2Ψ",
        "Adam m (fp32)": "4Ψ", "Adam v (fp32)": "4Ψ"}
    assert [est.stages[s].formula for s in range(4)] == ["16Ψ", "4Ψ + 12Ψ/N", "2Ψ + 14Ψ/N", "16Ψ/N"]


def test_seed_example_correct_values():
    """1B params, 4 devices: the seed prints 14.9/9.3/7.9/3.7 GiB as 'Total'; per device is 16/7/5.5/4 GB."""
    est = estimate(10**9, 4, dtype="fp16")
    assert [per_device(est, s) / GB for s in range(4)] == [16.0, 7.0, 5.5, 4.0]
    assert round(per_device(est, 0) / 2**30, 1) == 14.9


def test_tensor_parallel_divides_psi_and_adds_comm():
    facts = ModelFacts(params=10**9, model_type="x", hidden_size=2048, num_layers=24, num_heads=16,
                       num_kv_heads=16, vocab_size=50000, intermediate_size=8192,
                       largest_layer_params=10**8, largest_layer_name="embed")
    est = estimate(10**9, 8, tp=2, micro_batch=2, seq=1024, facts=facts)
    assert est.dp == 4 and est.psi == 5 * 10**8
    assert per_device(est, 0) == 16 * 5 * 10**8
    assert per_device(est, 3) == 16 * 5 * 10**8 // 4
    # 4 all-reduces of b·s·h per layer; ring all-reduce sends 2(t-1)/t of the buffer; 2 bytes each
    assert est.tp_comm_bytes == 24 * 4 * 2 * 1024 * 2048 * 2 * 2 * 1 // 2
    assert any("Ψ = params/tp" in note for note in est.notes)


def test_offload_moves_optimizer_then_params_to_host():
    psi, n = 10**9, 8
    est = estimate(psi, n, offload="optimizer")
    assert est.stages[0].offload == "none" and per_device(est, 0) == 16 * psi
    assert per_device(est, 1) == 4 * psi and est.stages[1].host_bytes == 12 * psi // n
    assert per_device(est, 2) == 2 * psi + 2 * psi // n
    assert per_device(est, 3) == 4 * psi // n and est.stages[3].host_bytes == 12 * psi // n
    est = estimate(psi, n, offload="params")
    assert est.stages[2].offload == "optimizer" and est.stages[3].offload == "params"
    assert per_device(est, 3) == 2 * psi // n and est.stages[3].host_bytes == 14 * psi // n
    assert per_device(est, 3) + est.stages[3].host_bytes == 16 * psi // n
    fp32 = estimate(psi, n, dtype="fp32", offload="optimizer")
    assert fp32.stages[2].host_bytes == 8 * psi // n
    assert per_device(fp32, 2) == 4 * psi + 4 * psi // n


def test_activation_formula_and_checkpointing():
    facts = model_facts(GPT2Config())
    s, b, h, a, L, V = 1024, 2, 768, 12, 12, 50257
    est = estimate(facts.params, 2, micro_batch=b, seq=s, facts=facts)
    per_layer = s * b * h * (34 + 5 * a * s / h)
    assert est.activations["per_layer_bytes"] == pytest.approx(per_layer)
    assert est.activations["layers_bytes"] == pytest.approx(L * per_layer)
    assert est.activations["logits_bytes"] == 4 * b * s * V
    tp2 = estimate(facts.params, 2, tp=2, micro_batch=b, seq=s, facts=facts)
    assert tp2.activations["per_layer_bytes"] == pytest.approx(per_layer / 2)
    ck = estimate(facts.params, 2, micro_batch=b, seq=s, facts=facts, activation_checkpointing=True)
    assert ck.activations["layers_bytes"] == pytest.approx(L * 2 * s * b * h + per_layer)
    assert ck.activations["layers_bytes"] < est.activations["layers_bytes"] / 5


def test_estimate_rejects_bad_arguments():
    with pytest.raises(ValueError, match="divisible"):
        estimate(10**9, 6, tp=4)
    with pytest.raises(ValueError):
        estimate(0, 8)


# ---------------------------------------------------------------- exact HF parameter counts

def test_gpt2_small_exact_count_and_facts():
    facts = model_facts(GPT2Config())
    V, P, L, h = 50257, 1024, 12, 768
    assert facts.params == 124_439_808 == V * h + P * h + L * (12 * h * h + 13 * h) + 2 * h
    assert (facts.hidden_size, facts.num_layers, facts.num_heads, facts.vocab_size) == (768, 12, 12, 50257)
    assert facts.intermediate_size == 4 * h
    assert facts.largest_layer_params == V * h and "wte" in facts.largest_layer_name


def _llama_cfg(tied: bool) -> LlamaConfig:
    return LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=8,
                       num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=tied)


def test_llama_gqa_untied_matches_hand_formula_and_real_model():
    cfg = _llama_cfg(tied=False)
    h, ffn, L, V, kv, hd = 64, 176, 3, 1000, 2, 64 // 8
    per_layer = h * h + 2 * h * (kv * hd) + h * h + 3 * h * ffn + 2 * h
    hand = V * h + V * h + h + L * per_layer
    facts = model_facts(cfg)
    assert facts.params == hand == 260_544
    assert facts.num_kv_heads == 2 and facts.num_heads == 8
    assert facts.largest_layer_params == V * h
    torch.manual_seed(0)
    real = AutoModelForCausalLM.from_config(cfg)
    assert sum(p.numel() for p in real.parameters()) == hand


def test_tied_embeddings_counted_once_and_paths(tmp_path):
    tied, untied = _llama_cfg(tied=True), _llama_cfg(tied=False)
    assert count_params(untied) - count_params(tied) == 1000 * 64
    small = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=64)
    real = AutoModelForCausalLM.from_config(small)
    expected = sum(p.numel() for p in real.parameters())  # parameters() yields the tied one once
    small.save_pretrained(tmp_path)
    assert count_params(tmp_path) == expected == count_params(tmp_path / "config.json")
    with pytest.raises(ValueError, match="config"):
        count_params(tmp_path / "missing")


# ---------------------------------------------------------------- recommendation

def test_7b_on_8x80gb_uses_stage_1_or_2():
    est = estimate(7 * 10**9, 8, device_memory=parse_bytes("80GB"))
    rec = est.recommendation
    assert rec["fits"] and rec["stage"] in (1, 2) and rec["offload"] == "none" and rec["tp"] == 1
    assert not est.candidates[0].fits  # stage 0 would need 112 GB
    assert "Stage" in rec["reason"] and "stage 0 needs 112.0 GB" in rec["reason"]


def test_70b_on_8x80gb_needs_stage_3_or_offload():
    est = estimate(70 * 10**9, 8, device_memory=parse_bytes("80GB"))
    rec = est.recommendation
    assert rec["fits"] and (rec["stage"] == 3 or rec["offload"] != "none")
    assert not any(c.fits for c in est.candidates if c.offload == "none")  # 16Ψ/N = 140 GB
    assert rec["device_need_bytes"] <= 0.9 * 80 * GB


def test_huge_layer_recommends_tensor_parallel():
    facts = ModelFacts(params=7 * 10**9, model_type="llama", hidden_size=4096, num_layers=32, num_heads=32,
                       num_kv_heads=32, vocab_size=32000, intermediate_size=11008,
                       largest_layer_params=202_000_000, largest_layer_name="block 0")
    est = estimate(facts.params, 8, micro_batch=1, seq=4096, facts=facts, device_memory=80 * GB)
    assert est.activations["total_bytes"] > 72 * GB  # ~104 GB of activations without checkpointing
    rec = est.recommendation
    assert rec["fits"] and rec["tp"] > 1 and rec["offload"] == "none" and "tp=" in rec["reason"]
    assert not any(c.fits for c in est.candidates if c.tp == 1)  # offload cannot shrink activations
    assert est.candidates[-1].tp == rec["tp"] and est.candidates[-1].fits
    assert json.loads(json.dumps(est.to_dict()))["recommendation"]["tp"] == rec["tp"]
    ck = estimate(facts.params, 8, micro_batch=1, seq=4096, facts=facts, device_memory=80 * GB,
                  activation_checkpointing=True)
    assert ck.recommendation["tp"] == 1 and ck.recommendation["stage"] in (1, 2)


def test_nothing_fits_is_reported():
    est = estimate(10**12, 2, device_memory=8 * GB)
    assert est.recommendation["fits"] is False and "Nothing fits" in est.recommendation["reason"]
    assert "Closest option" in format_report(est)


def test_report_has_units_tables_and_aligned_columns():
    text = format_report(estimate(10**9, 4, dtype="fp16", device_memory=80 * GB))
    assert "GB = 1e9 bytes" in text and "GiB" in text
    assert "4Ψ + 12Ψ/N" in text and "Recommendation: stage 0" in text
    table = text.split("ZeRO stages")[1].split("\n\n")[0].splitlines()[1:]
    second_col = {re.match(r"\S+\s+", line).end() for line in table}  # every row's column 2 starts together
    assert len(second_col) == 1
    ends = {len(line) for line in table[2:]}  # right-aligned numbers end at the same column
    assert len(ends) == 1


# ---------------------------------------------------------------- CLI

def test_cli_json(capsys):
    assert main(["--params", "7.5B", "--devices", "64", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["params"] == 7_500_000_000
    assert data["stages"]["0"]["per_device_bytes"] == 120 * GB
    assert data["stages"]["3"]["per_device_bytes"] == 16 * 7_500_000_000 // 64
    assert set(data["stages"]) == {"0", "1", "2", "3"}


def test_cli_model_text_report(tmp_path, capsys):
    GPT2Config().save_pretrained(tmp_path)
    argv = ["--model", str(tmp_path), "--devices", "2", "--micro-batch", "1", "--seq", "512",
            "--device-memory", "24GiB", "--activation-checkpointing"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "124,439,808 params" in out and "Recommendation: stage 0" in out and "per layer" in out


@pytest.mark.parametrize("argv,flag", [
    (["--params", "7X", "--devices", "8"], "--params"),
    (["--params", "1B", "--devices", "6", "--tp", "4"], "--tp"),
    (["--params", "1B", "--devices", "0"], "--devices"),
    (["--params", "1B", "--devices", "8", "--device-memory", "80GX"], "--device-memory"),
    (["--params", "1B", "--devices", "8", "--micro-batch", "2", "--seq", "128"], "--model"),
    (["--model", "/nonexistent/dir", "--devices", "8"], "--model"),
    (["--devices", "8"], "--params"),
])
def test_cli_bad_input_exits_2_naming_flag(argv, flag, capsys):
    assert main(argv) == 2
    assert flag in capsys.readouterr().err


def test_cli_help_has_examples(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.count("shardwise estimate --") >= 3 and "GiB" in out
