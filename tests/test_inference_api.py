"""shardwise.init_inference with DeepSpeed's call forms (``deepspeed.init_inference(model, config,
**kwargs)``, ``tensor_parallel={"tp_size": n}`` or ``mp_size``, ``dtype``, kernel options, ``.module``),
against plain transformers; options that would change the math are refused by name."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build
from tp_cases import GEN, _prompt

import shardwise
from shardwise.config.schema import ConfigError
from shardwise.inference.compat import _translate


def test_deepspeed_options_translate_to_shardwise_keywords():
    assert _translate({"tensor_parallel": {"tp_size": 2, "tp_grain_size": 64}}) == {"tensor_parallel_size": 2}
    assert _translate({"tp": {"enabled": False, "tp_size": 4}}) == {"tensor_parallel_size": 1}
    assert _translate({"mp_size": 2, "dtype": "bf16"}) == {"tensor_parallel_size": 2, "dtype": torch.bfloat16}
    assert _translate({"dtype": torch.half, "replace_with_kernel_inject": True, "max_out_tokens": 64,
                       "enable_cuda_graph": False, "checkpoint": None, "zero": {}}) == {"dtype": torch.float16}
    assert _translate({"offload": "disk", "prefetch": 2}) == {"offload": "disk", "prefetch": 2}


@pytest.mark.parametrize(("options", "error", "match"), [
    ({"tensor_parallel": {"tp_size": 2}, "mp_size": 4}, ConfigError, "asks for 4"),
    ({"tensor_parallel": {"tp_size": 0}}, ConfigError, "tp_size must be a positive integer"),
    ({"tensor_parallel": {"tp_sise": 2}}, ConfigError, "tp_sise"),
    ({"tensor_parallel": {"tp_size": 2, "tp_group": object()}}, NotImplementedError, "tp_group"),
    ({"dtype": torch.int8}, NotImplementedError, "int8"),
    ({"dtype": "fp64"}, ConfigError, "fp32, fp16 or bf16"),
    ({"checkpoint": "ckpt.json"}, NotImplementedError, "'checkpoint'"),
    ({"zero": {"stage": 3}}, NotImplementedError, "'zero'"),
    ({"quant": {"enabled": True}}, NotImplementedError, "'quant'"),
    ({"moe": True}, NotImplementedError, "'moe'"),
    ({"replace_with_kernel_injection": True}, ConfigError, "did you mean 'replace_with_kernel_inject'"),
])
def test_options_that_change_the_math_or_are_unknown_are_refused(options, error, match):
    with pytest.raises(error, match=match):
        _translate(options)


def test_single_process_call_forms_generate_what_transformers_generates(tmp_path):
    ref = build("llama").eval()
    with torch.no_grad():
        want = ref.generate(_prompt(), **GEN).tolist()
    config = tmp_path / "inference.json"
    config.write_text('{"dtype": "fp32", "replace_with_kernel_inject": true}')
    for call in (lambda m: shardwise.init_inference(m),
                 lambda m: shardwise.init_inference(m, config=str(config), max_out_tokens=32),
                 lambda m: shardwise.init_inference(m, {"tensor_parallel": {"tp_size": 1}}, dtype=torch.float32)):
        engine = call(build("llama").eval())
        assert engine.module is engine and "module" not in dict(engine.named_children())
        assert set(engine.state_dict()) == set(ref.state_dict())
        with torch.no_grad():
            assert engine.module.generate(_prompt(), **GEN).tolist() == want
            assert engine.generate(_prompt(), **GEN).tolist() == want


@pytest.mark.parametrize("form", ["kwargs", "config"])
def test_deepspeed_tensor_parallel_call_equals_transformers(pool2, tmp_path, form):
    ref = build("llama").eval()
    ref.save_pretrained(tmp_path)
    with torch.no_grad():
        want = ref.generate(_prompt(), **GEN).tolist()
    for tokens in pool2.run("inference_api_cases:deepspeed_style_tp", str(tmp_path), form):
        assert tokens == want
