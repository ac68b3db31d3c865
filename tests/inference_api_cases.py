"""Rank-side cases for tests/test_inference_api.py: DeepSpeed's init_inference call forms."""

from __future__ import annotations

import torch
from tp_cases import GEN, _prompt
from transformers import AutoModelForCausalLM

import shardwise


def deepspeed_style_tp(folder: str, form: str) -> list:
    """Greedy tokens of a from_pretrained model given to init_inference as DeepSpeed scripts do."""
    import torch.distributed as dist

    model = AutoModelForCausalLM.from_pretrained(folder)
    world = dist.get_world_size()
    if form == "kwargs":
        engine = shardwise.init_inference(model, tensor_parallel={"tp_size": world}, dtype=torch.float32,
                                          replace_with_kernel_inject=True)
    else:  # the older mp_size keyword, inside a config dict
        engine = shardwise.init_inference(model, config={"mp_size": world, "dtype": "fp32"})
    assert engine.module is engine
    with torch.no_grad():
        return engine.module.generate(_prompt(), **GEN).tolist()
