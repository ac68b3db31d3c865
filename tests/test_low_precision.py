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
from shardwise.zero.low_precision import round_stochastic, step_group
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
    moments = "torch.bfloat16" if mode == "states" else "torch.float32"
    comp = {f"torch.{'bfloat16' if precision == 'bf16' else 'float16'}"} if update == "kahan" else set()
    assert res[0]["state_dtypes"] == sorted({moments} | comp)
    _check_exact(res, precision, mode, update, stage)


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
