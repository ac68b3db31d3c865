"""ZeRO stage 3 against single-process PyTorch, plus its memory, traffic and API guarantees."""

from __future__ import annotations

import pytest
from test_zero import FP32_TOL, _check_equivalent
from zero_cases import make_config, max_rel_diff, reference, update_rel_err

S3 = dict(stage3_param_persistence_threshold=0)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_stage3_fp32_matches_single_process(pool2, kind):
    cfg = make_config(3, **S3)
    res = pool2.run("zero_cases:train_ranks", kind, cfg)
    _check_equivalent(res, reference(kind, cfg))
    if kind == "gpt2":
        assert res[0]["tied"] is True


def test_stage3_accumulation_clipping_overlap_persistence(pool2):
    cfg = make_config(3, gas=2, clip=0.05, overlap=True, stage3_param_persistence_threshold=100,
                      stage3_prefetch_bucket_size=10_000)
    res = pool2.run("zero_cases:train_ranks", "llama", cfg)
    _check_equivalent(res, reference("llama", cfg))


def test_stage3_param_and_optimizer_offload(pool2):
    cfg = make_config(3, offload=True, offload_param={"device": "cpu", "pin_memory": True}, **S3)
    res = pool2.run("zero_cases:train_ranks", "llama", cfg)
    _check_equivalent(res, reference("llama", cfg))
    assert res[0]["master_device"] == "cpu" and res[0]["opt_state_devices"] == ["cpu"]


def test_stage3_bf16_close_to_fp32(pool2):
    res = pool2.run("zero_cases:train_ranks", "llama", make_config(3, precision="bf16", **S3))
    ref = reference("llama", make_config(3))
    for r in range(2):
        assert res[r]["losses"] == pytest.approx(ref["losses"][r], rel=1e-3)
    assert update_rel_err(res[0]["weights"], ref["weights"], "llama") < 0.15


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_stage3_memory_is_16_psi_over_n(pool2, precision):
    res = pool2.run("zero_cases:train_ranks", "llama", make_config(3, precision=precision, **S3), steps=1)
    m, psi, n = res[0]["memory"], res[0]["numel"], 2
    states = m["params"] + m["grads"] + m["master_params"] + m["optimizer_states"]
    # after the step: the gradient shards (4 or 2 bytes) are let go, as FSDP2 frees its gradients, and
    # bf16 keeps no 16-bit parameter shard beside its fp32 master (store.MasterStore): 4 + 8 bytes either way
    assert m["grads"] == 0
    expected = 12 * psi / n
    assert abs(states - expected) <= 0.02 * expected, (states, expected)
    assert m["peak_gathered_params"] > 0


def test_stage3_peak_gathered_within_prefetch_bound(pool2):
    layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 96 + 2 * 64  # one tiny Llama decoder layer
    root = 509 * 64 * 2 + 64
    for prefetch, extra_layers in ((0, 1), (layer, 2)):
        cfg = make_config(3, stage3_prefetch_bucket_size=prefetch, **S3)
        res = pool2.run("zero_cases:train_ranks", "llama", cfg, steps=1)
        peak = res[0]["memory"]["peak_gathered_params"]
        bound = 4 * (root + extra_layers * layer) + 4 * 2 * 3  # fp32, a few pad elements
        assert peak <= bound, (prefetch, peak, bound)
        if prefetch == 0:  # root + one of the two layers: never the whole model at once
            assert peak < 4 * res[0]["numel"]


def test_stage3_moves_1_5x_stage2_bytes(pool2):
    c2 = pool2.run("zero_cases:train_ranks", "llama", make_config(2), steps=2)[0]["comm"]
    c3 = pool2.run("zero_cases:train_ranks", "llama", make_config(3, **S3), steps=2)[0]["comm"]
    step2 = c2["reduce_scatter"] + c2["all_gather"]
    step3 = c3["reduce_scatter"] + c3["all_gather"]
    assert step3 / step2 == pytest.approx(1.5, rel=0.01)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("whole", [True, False])
def test_stage3_generate_matches_single_process(pool2, kind, whole):
    from stage3_cases import reference_generate

    toks = pool2.run("stage3_cases:generate_stage3", kind, whole)
    assert toks[0] == toks[1] == reference_generate(kind)


def test_no_silent_placeholders(pool2):
    out = pool2.run("stage3_cases:placeholders_and_guard")[0]
    assert out["shape"] == (96, 64) and out["all_nan"]
    assert "GatheredParameters" in out["state_dict_error"]
    assert out["gathered_ok"]


def test_gathered_parameters_modifier_rank(pool2):
    out = pool2.run("stage3_cases:modifier_rank_broadcast")
    assert out[0]["seen"] == out[1]["seen"] == pytest.approx(0.125)
    assert out[0]["loss_finite"]


@pytest.mark.parametrize("stage", [2, 3])
def test_frozen_parameters_get_no_optimizer_state(pool2, stage):
    from stage3_cases import reference_frozen

    res = pool2.run("stage3_cases:frozen_embeddings", stage)
    ref = reference_frozen()
    for r in range(2):
        assert res[r]["losses"] == pytest.approx(ref["losses"][r], rel=FP32_TOL)
    assert max_rel_diff(res[0]["weights"], ref["weights"]) < FP32_TOL
    # AdamW holds m and v for this rank's shard of the trainable parameters only
    assert res[0]["state_numel"] <= 2 * (res[0]["trainable"] // 2 + 64 * 8)


def test_stage3_four_ranks(pool4):
    cfg = make_config(3, dp=4, micro=1, **S3)
    res = pool4.run("zero_cases:train_ranks", "llama", cfg)
    _check_equivalent(res, reference("llama", cfg, world=4))


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_zero_init_from_pretrained_reads_slices_and_trains_identically(pool2, kind, tmp_path):
    from tiny_models import build

    build(kind).save_pretrained(tmp_path)
    cfg = make_config(3, **S3)
    res = pool2.run("zero_cases:train_ranks", kind, cfg, pretrained=str(tmp_path))
    _check_equivalent(res, reference(kind, cfg))
    file_bytes = (tmp_path / "model.safetensors").stat().st_size
    for r in res:  # each rank read about half the weights (whole rows at shard edges)
        assert r["bytes_read"] < 0.6 * file_bytes, (r["bytes_read"], file_bytes)


@pytest.mark.subprocess
def test_zero_init_from_config_peak_memory():
    """A ~490 MB model built under zero.Init on 2 ranks: peak growth ~ model/2 + a unit, not the model.

    RSS is made honest by having glibc return every freed block over 64 KiB to the OS (otherwise
    it keeps freed memory and the peak hides the savings): ``mallopt(M_MMAP_THRESHOLD, 64 KiB)`` in
    two new ranks forked after the imports. Measured (AMD EPYC, 2026-12-05): 306 MB per rank, and
    314 MB in new interpreters started with ``MALLOC_MMAP_THRESHOLD_=65536`` (model/2 is 244 MB, one
    unit 40 MB, the bound 356 MB); 410-442 MB without the threshold, over the bound.
    """
    from rank_pool import run_fresh

    out = run_fresh(2, "stage3_cases:build_under_init_peak", 12, 1024, mmap_threshold=65536, timeout_s=120)
    for r in out:
        assert r["norm_ok"] and 0.015 < r["std"] < 0.025  # the model's own init ran (std 0.02)
        assert r["peak"] < 0.5 * r["model_bytes"] + 2 * r["layer_bytes"] + 32 * 2**20, r
        assert r["peak"] < 0.9 * r["model_bytes"], r


def test_stage3_changing_forward_path_rerecords_order_silently(pool2):
    from stage3_cases import branchy_train

    res = pool2.run("stage3_cases:branchy_train", 2)
    ref = branchy_train(None)
    assert max_rel_diff(res[0]["weights"], ref) < FP32_TOL
    assert res[0]["warnings"] == []


@pytest.mark.parametrize("stage", [2, 3])
def test_gradient_checkpointing(pool2, stage):
    """HF checkpointing recomputes `forward` inside backward, outside the module hooks, after
    stage 3's pre-backward gather: the recomputed unit sees its full parameters."""
    cfg = make_config(stage, **S3) if stage == 3 else make_config(stage)
    res = pool2.run("stage3_cases:checkpointed_train", "llama", cfg)
    _check_equivalent(res, reference("llama", cfg))
    assert res[0]["mlp_calls"] == 2 * 2 * 3  # 2 layers x 3 steps, each forward recomputed once


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_stage3_backward_leaves_nothing_gathered_or_held(pool2, precision):
    """After backward, as FSDP2: every group resharded, no gradient bucket, receive chunk or reduction
    left, so what is live is the model states of ``memory_report()`` and nothing else."""
    for after in pool2.run("stage3_cases:after_backward_state", precision)[0]:
        assert after["gathered"] == [] and after["buckets"] == after["pending"] == after["in_use"] == 0, after
        assert after["comm_buffers"] == 0, after
        # the shards only, not a gathered byte; bf16: none beside the fp32 master (store.MasterStore), which
        # holds twice a bf16 shard's bytes
        assert after["params"] == (after["shard_bytes"] if precision == "fp32" else 0), after
        assert after["master_params"] == (0 if precision == "fp32" else 2 * after["shard_bytes"]), after
        # the only other live storages: this step's batch, the loss and a few 0-d scalars (bytes)
        assert 0 <= after["live"] - after["report_total"] <= after["batch_bytes"] + 1024, after
