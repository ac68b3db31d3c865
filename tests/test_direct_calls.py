"""ZeRO-3: every submodule of tiny HF models called on its own computes what the plain model does.

Before shardwise.zero.stage3.direct_calls, a module called directly (``t5.get_encoder()(ids)`` inside
``generate``, ``lm_head`` in a fused loss) ran with NaN placeholders for every parameter that the
root's or its unit's hooks gather: no error, NaN outputs. Each case runs on 2 gloo ranks with every
parameter sharded (persistence threshold 0) and compares against the plain model bit for bit (same
weights, same kernels, same inputs; see direct_call_cases.py).
"""

from __future__ import annotations

import pytest
import torch

ARCHS = ["llama", "llama-tied", "gpt2", "t5"]


@pytest.mark.parametrize("kind", ARCHS)
def test_every_submodule_called_alone_equals_plain(pool2, kind):
    res = pool2.run("direct_call_cases:every_submodule", kind)
    for r in res:
        assert len(r["called"]) > 20
        assert r["never_called_with_params"] == []  # left out: containers, and dropouts eager attention skips
        assert r["wrong"] == {}, r["wrong"]
        assert r["leaked"] == {}, r["leaked"]  # and released what it gathered


@pytest.mark.parametrize(("kind", "front", "extra"), [
    ("t5", "engine", {}),
    ("llama", "engine", {"offload_param": {"device": "cpu"}}),
    ("gpt2", "shard", {"offload": "param"}),
])
def test_every_submodule_other_stage3_configurations(pool2, kind, front, extra):
    """The engine (DeepSpeed config) and parameter offload take the same path."""
    res = pool2.run("direct_call_cases:every_submodule", kind, front, **extra)
    for r in res:
        assert r["wrong"] == {} and r["leaked"] == {}, (r["wrong"], r["leaked"])
        assert len(r["called"]) > 20


@pytest.mark.parametrize(("kind", "front"), [(k, "shard") for k in ARCHS] + [("t5", "engine")])
def test_backward_through_direct_calls_gives_plain_gradients(pool2, kind, front):
    """A loss built only from directly called submodules (body, then head; encoder, decoder and head;
    an inner MLP alone) and a plain ``loss.backward()``: every parameter's gradient equals the plain
    model's bit for bit (both ranks use the same batch, so the rank average is exact)."""
    from direct_call_cases import reference_grads

    ref = reference_grads(kind)
    res = pool2.run("direct_call_cases:backward_through_direct_calls", kind, front)
    for r in res:
        assert r["leaked"] == []
        assert set(r["grads"]) == set(ref)
        bad = [n for n in ref if not torch.equal(r["grads"][n], ref[n])]
        assert bad == [], bad


def test_cached_reference_refused_by_name_then_registered(pool2):
    """A direct call whose forward reaches a released parameter through a cached reference raises,
    naming the parameter and the module; registered as an external parameter, it runs exactly."""
    res = pool2.run("direct_call_cases:cached_reference", False)
    for r in res:
        assert "'embed.weight'" in r["error"] and "'head'" in r["error"], r["error"]
        assert "register_external_parameter" in r["error"]
        assert r["leaked"] == []
    res = pool2.run("direct_call_cases:cached_reference", True)
    assert all(r["equal"] and r["leaked"] == [] for r in res), res


def test_paramless_module_with_registered_external(pool2):
    res = pool2.run("direct_call_cases:paramless_registered_head")
    assert all(r["equal"] and r["leaked"] == [] for r in res), res


@pytest.mark.parametrize("front", ["shard", "engine"])
def test_t5_generate_equals_plain(pool2, front):
    """generate() runs the encoder on its own (this used to give NaN and all-pad predictions)."""
    res = pool2.run("direct_call_cases:t5_generate", front)
    for r in res:
        assert r["equal"] and r["finite"] and r["leaked"] == [], r


def test_gathered_parameters_skips_none_entries(pool2):
    res = pool2.run("direct_call_cases:gathered_with_none")
    assert all(r["row_is_3"] and r["leaked"] == [] for r in res), res
