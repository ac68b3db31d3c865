"""DeepSpeed's low-precision master keys (zero/low_precision.py) at every stage, 2 gloo ranks.

Each run is held to a single-process reference doing the same arithmetic (low_precision_cases.py:
plain torch AdamW, fused as the engine picks it, over fp32 windows of bf16/fp16 parameters) in the
same cross-rank summation order as the stage. The two are then the same sequence of IEEE operations
on the same kernels and shapes (each forward/backward is one rank's micro-batch; the reductions add
two values, correctly rounded; the optimizer is elementwise, so the engine's flat chunks and the
reference's per-parameter tensors compute each element alike): losses and weights must be
bit-identical, the strongest claim the math allows. (A tolerance derived from the other summation
order would be useless here: reordering two bf16 sums moves bf16 weights by whole ulps, 3%
relative on the smallest tensors, measured.)
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
from low_precision_cases import WindowAdamW, lowp_config, reference

from shardwise.zero import low_precision
from shardwise.zero.low_precision import COMPENSATION, round_stochastic, step_group
from shardwise.zero.policy import PrecisionPolicy

ORDER = {0: "rank", 1: "rank", 2: "micro", 3: "micro"}  # where each stage sums over ranks


@functools.cache
def _ref(precision: str, mode: str, update: str, order: str) -> dict:
    return reference(precision, mode, update, order)


def _check_exact(res: list[dict], precision: str, mode: str, update: str, stage: int) -> None:
    ref = _ref(precision, mode, update, ORDER[stage])
    for r in range(2):
        assert res[r]["losses"] == ref["losses"][r], (r, res[r]["losses"], ref["losses"][r])
    for n, want in ref["weights"].items():
        assert torch.equal(res[0]["weights"][n], want), (n, (res[0]["weights"][n] - want).abs().max())


CASES = [  # (stage, precision, mode, update, offload)
    (0, "bf16", "states", "kahan", False), (1, "bf16", "states", "kahan", False),
    (2, "bf16", "states", "kahan", False), (3, "bf16", "states", "kahan", False),
    (1, "bf16", "master", "kahan", False), (3, "bf16", "master", "nearest", False),
    (2, "bf16", "states", "nearest", False), (2, "fp16", "master", "kahan", False),
    (1, "bf16", "master", "kahan", True), (3, "bf16", "states", "kahan", True),
]


@pytest.mark.parametrize(("stage", "precision", "mode", "update", "offload"), CASES)
def test_low_precision_master_matches_reference_bit_exact(pool2, stage, precision, mode, update, offload):
    cfg = lowp_config(stage, mode, update, precision=precision, offload=offload)
    res = pool2.run("low_precision_cases:train_ranks", cfg)
    assert res[0]["master_dtype"] == f"torch.{'bfloat16' if precision == 'bf16' else 'float16'}"
    assert res[0]["master_is_view"] is (not offload)  # no second copy on the device
    assert res[0]["accessors"] == [precision == "bf16", mode == "states", precision == "fp16"]  # DeepSpeed's names
    moments = "torch.bfloat16" if mode == "states" else "torch.float32"
    comp = {f"torch.{'bfloat16' if precision == 'bf16' else 'float16'}"} if update == "kahan" else set()
    assert res[0]["state_dtypes"] == sorted({moments} | comp)
    _check_exact(res, precision, mode, update, stage)
    if stage < 3:  # (stage 3 keeps this tiny model's parameters whole: the persistence threshold)
        _check_memory(res[0], stage, precision, mode, update, offload)


def _check_memory(r: dict, stage: int, precision: str, mode: str, update: str, offload: bool) -> None:
    """memory_report()'s model states (device and host) against `shardwise estimate --master`'s bytes per
    parameter; the only difference allowed is the engine's per-group padding (< 16 bytes x N elements a group)."""
    from shardwise.estimate import estimate

    est = estimate(r["numel"], 2, dtype=precision, offload="optimizer" if offload else "none", master=mode,
                   kahan=update == "kahan").stages[stage]
    got = sum(r["memory"][k] for k in ("params", "grads", "master_params", "optimizer_states"))
    want = est.per_device_bytes + est.host_bytes
    assert abs(got - want) <= 16 * 2 * 20, (got, want, r["memory"])  # 20 groups at most in this model


def _fake_group(master: torch.Tensor, update: str, state_dtype: torch.dtype) -> SimpleNamespace:
    return SimpleNamespace(master=master, comm=SimpleNamespace(rank=0),
                           precision=PrecisionPolicy(master.dtype, state_dtype=state_dtype, master_update=update))


@pytest.mark.parametrize("update", ["kahan", "nearest"])
def test_window_chunks_are_exact_and_match_plain_adamw(monkeypatch, update):
    """The chunked window (7-element chunks, a tail of 3) equals plain AdamW on fp32 windows, bit for bit."""
    torch.manual_seed(0)
    start = torch.randn(31).to(torch.bfloat16)
    grads = [torch.randn(31).to(torch.bfloat16) for _ in range(4)]
    monkeypatch.setattr(low_precision, "CHUNK", 7)
    m = start.clone()
    opt = torch.optim.AdamW([m], lr=1e-3, weight_decay=0.01, fused=True)
    g = _fake_group(m, update, torch.bfloat16)
    p = start.clone()
    ref = WindowAdamW([p], torch.bfloat16, update)
    ref.opt.param_groups[0].update(lr=1e-3, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8)
    for gr in grads:
        m.grad = gr.clone()
        step_group(opt, g, {k: v for k, v in opt.param_groups[0].items() if k != "params"}, 0)
        ref.step([gr.clone()])
        assert torch.equal(m, p)
    assert opt.state[m]["exp_avg"].dtype == torch.bfloat16 and float(opt.state[m]["step"]) == 4


def test_kahan_keeps_updates_nearest_rounding_loses():
    """An update of 1/4 bf16 ulp, 64 times: nearest rounding never moves the weight, Kahan moves it by 16 ulps."""
    moved = {}
    for update in ("nearest", "kahan"):
        m = torch.ones(8, dtype=torch.bfloat16)
        opt = torch.optim.SGD([m], lr=1.0)
        g = _fake_group(m, update, torch.float32)
        for _ in range(64):
            m.grad = torch.full((8,), -(2.0 ** -7) / 4, dtype=torch.bfloat16)  # bf16 ulp at 1.0 is 2^-7
            step_group(opt, g, {k: v for k, v in opt.param_groups[0].items() if k != "params"}, 0)
        moved[update] = float(m[0]) - 1.0
    assert moved["nearest"] == 0.0 and moved["kahan"] == 64 * 2.0 ** -9


def test_stochastic_rounding_is_unbiased_and_between_neighbours():
    x = torch.full((200_000,), 1.0 + 2.0 ** -9)  # a quarter of the way from 1 to the next bf16 (1 + 2^-7)
    r = round_stochastic(x, torch.Generator().manual_seed(0)).float()
    assert set(r.unique().tolist()) == {1.0, 1.0 + 2.0 ** -7}
    frac = float((r > 1.0).double().mean())
    assert abs(frac - 0.25) < 5 * (0.25 * 0.75 / x.numel()) ** 0.5  # 5 sigma of a binomial
    neg = round_stochastic(-x, torch.Generator().manual_seed(0)).float()
    assert torch.equal(neg, -r)  # sign-magnitude: the same rounding of the magnitude


# -- the keys: accepted where DeepSpeed accepts them, refused in one line naming the key otherwise -------
def _load(extra: dict) -> object:
    from shardwise.config import load_config
    from shardwise.config.schema import SupportedFeatures

    base = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}
    return load_config({**base, **extra}, world_size=1, supported=SupportedFeatures.everything())


@pytest.mark.parametrize(("extra", "dtypes"), [
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, (torch.bfloat16, torch.float32)),
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}},
     (torch.bfloat16, torch.bfloat16)),
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, (torch.float16, torch.float32)),
    ({"bf16": {"enabled": True}}, (torch.float32, torch.float32)),  # the default: fp32 masters
])
def test_keys_give_master_and_state_dtypes(extra, dtypes):
    assert _load(extra).master_dtypes == dtypes


@pytest.mark.parametrize(("extra", "key"), [
    ({"bf16": {"enabled": True, "bf16_optimizer_states": True}}, "bf16.bf16_optimizer_states"),
    ({"fp16": {"enabled": True}, "bf16": {"bf16_master_weights_and_grads": True}},
     "bf16.bf16_master_weights_and_grads"),
    ({"bf16": {"enabled": False, "bf16_master_weights_and_grads": True}}, "bf16.bf16_master_weights_and_grads"),
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}, "data_types": {"grad_accum_dtype": "fp32"}},
     "bf16.bf16_master_weights_and_grads"),
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}, "shardwise": {"master_update": "stochastic"}},
     "shardwise.master_update"),
])
def test_contradictions_are_refused_naming_the_key(extra, key):
    from shardwise.config.schema import ConfigError

    with pytest.raises(ConfigError) as info:
        _load(extra)
    msg = str(info.value)
    assert key in msg and "\n" not in msg, msg


def test_non_elementwise_optimizer_is_refused(pool2):
    """Lamb reads whole tensors: the chunked window could not step it exactly, so the engine refuses."""
    msgs = pool2.run("low_precision_cases:refusal", lowp_config(2, "states"), "Lamb")
    assert msgs[0].startswith("bf16.bf16_master_weights_and_grads: a low-precision master is stepped by a torch "
                              "elementwise optimizer") and msgs[0].endswith("got Lamb"), msgs[0]


# -- checkpoints ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def kahan_ckpt(pool2, tmp_path_factory):
    """bf16 master + bf16 states + Kahan, stage 2: 4 uninterrupted steps, a checkpoint at step 2."""
    root = tmp_path_factory.mktemp("lowp_ckpt")
    res = pool2.run("low_precision_cases:ckpt_run", 2, "states", str(root / "ckpt"))
    return {"res": res, "ckpt": root / "ckpt", "root": root}


@pytest.mark.parametrize("stage", [2, 3, 1])
def test_low_precision_checkpoint_resumes_bit_exact_at_any_stage(pool2, kahan_ckpt, stage):
    """Master, moments and the Kahan compensation are saved and resharded: the resumed run is the
    uninterrupted one, bit for bit (with one micro-batch per step every stage sums the two ranks alike)."""
    import json

    meta = json.loads((kahan_ckpt["ckpt"] / "global_step2" / "metadata.json").read_text())
    assert meta["master_dtype"] == "bfloat16" and meta["states"] == ["exp_avg", "exp_avg_sq", COMPENSATION]
    assert set(meta["state_dtypes"].values()) == {"bfloat16"}
    res = pool2.run("low_precision_cases:ckpt_run", stage, "states", None, str(kahan_ckpt["ckpt"]), seed=123)
    base = kahan_ckpt["res"]
    for r in range(2):
        assert res[r]["losses"] == base[r]["losses"][2:] and res[r]["global_steps"] == 4
    assert all(torch.equal(res[0]["at"][n], w) for n, w in base[0]["at"].items())
    assert all(torch.equal(res[0]["end"][n], w) for n, w in base[0]["end"].items())


@pytest.mark.parametrize("mode", ["fp32", "master"])
def test_bf16_master_checkpoint_loads_into_other_modes(pool2, kahan_ckpt, mode):
    """bf16 masters and bf16 moments upcast exactly into fp32 masters / fp32 moments: the loaded weights
    are the saved ones, and training goes on (the next steps' losses within 1% of the bf16 run's)."""
    res = pool2.run("low_precision_cases:ckpt_run", 2, mode, None, str(kahan_ckpt["ckpt"]), seed=123)
    base = kahan_ckpt["res"]
    assert all(torch.equal(res[0]["at"][n], w) for n, w in base[0]["at"].items())
    for r in range(2):
        assert res[r]["losses"] == pytest.approx(base[r]["losses"][2:], rel=1e-2)


def test_fp32_master_checkpoint_loads_into_bf16_master_and_back(pool2, tmp_path):
    """An fp32-master run's checkpoint resumed with bf16 masters (each master rounded to bf16 once, the
    weights the fp32 run computed with), and that run's checkpoint resumed with fp32 masters again."""
    base = pool2.run("low_precision_cases:ckpt_run", 2, "fp32", str(tmp_path / "fp32"))
    down = pool2.run("low_precision_cases:ckpt_run", 3, "states", None, str(tmp_path / "fp32"), seed=123)
    assert all(torch.equal(down[0]["at"][n], w) for n, w in base[0]["at"].items())  # bf16 params = rounded masters
    assert down[0]["loaded_compensation"] and max(down[0]["loaded_compensation"]) > 0  # the fp32 residual kept
    for r in range(2):
        assert down[r]["losses"][0] == base[r]["losses"][2]  # the same bf16 weights, the same batch
        assert down[r]["losses"] == pytest.approx(base[r]["losses"][2:], rel=1e-2)
    mid = pool2.run("low_precision_cases:ckpt_run", 2, "states", str(tmp_path / "bf16"))
    back = pool2.run("low_precision_cases:ckpt_run", 1, "fp32", None, str(tmp_path / "bf16"), seed=123)
    assert all(torch.equal(back[0]["at"][n], w) for n, w in mid[0]["at"].items())


def test_consolidate_and_zero_to_fp32_export_bf16_masters(kahan_ckpt, tmp_path):
    """The exported fp32 weights are the bf16 masters, upcast (exactly the engine's weights at the save)."""
    from transformers import AutoModelForCausalLM

    from shardwise.checkpoint import consolidate
    from shardwise.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    consolidate(kahan_ckpt["ckpt"], tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    want = kahan_ckpt["res"][0]["at"]
    assert all(p.dtype == torch.float32 and torch.equal(p, want[n]) for n, p in hf.named_parameters())
    sd = get_fp32_state_dict_from_zero_checkpoint(str(kahan_ckpt["ckpt"]))
    assert all(torch.equal(sd[n], w) for n, w in want.items())


@pytest.mark.parametrize(("master", "kahan", "total", "stage3_device", "stage3_host"), [
    ("fp32", True, 16, 16, 0), ("master", True, 14, 14, 0), ("master", False, 12, 12, 0),
    ("states", True, 10, 10, 0), ("states", False, 8, 8, 0),
])
def test_estimate_bytes_per_parameter(master, kahan, total, stage3_device, stage3_host):
    """docs/precision.md's table: ZeRO's 16 bytes per parameter become 14, 12, 10 or 8; with optimizer
    offload the device keeps 2 + 2 and the host the master copy, moments and compensation."""
    from shardwise.estimate import estimate

    psi, n = 1_000_000, 4
    est = estimate(psi, n, dtype="bf16", master=master, kahan=kahan)
    assert sum(c.bytes for c in est.components) == total * psi
    assert est.stages[3].per_device_bytes == stage3_device * psi // n and est.stages[3].host_bytes == stage3_host
    off = estimate(psi, n, dtype="bf16", offload="optimizer", master=master, kahan=kahan).stages[3]
    assert off.per_device_bytes == 4 * psi // n and off.per_device_bytes + off.host_bytes == total * psi // n + (
        2 * psi // n if master != "fp32" else 0)  # the master's host copy: the 16-bit params stay on the device
