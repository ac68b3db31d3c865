"""ALST's activation-checkpoint offload (shardwise/sequence_parallel/offload.py), in one CPU process.

Claims: (1) losses and gradients are bit-exact against HF activation checkpointing without offload,
both checkpoint flavours (the copies move bits, the recompute sees the same input); (2) the bytes
autograd keeps outside the offload store drop by exactly the checkpoint inputs (``L`` layers x
``b x s x h`` fp32 values), which the store holds instead, and the layers' input tensors are no
longer kept alive by autograd. On CPU the store is the same memory, so what this counts is the GPU
saving, not a measured one (benchmarks/gpu_check.py measures it on a GPU).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks
from transformers import AutoModelForCausalLM, LlamaConfig

from shardwise.sequence_parallel import offload_checkpoints

B, S, H, LAYERS, VOCAB = 2, 24, 32, 3, 97


def _model(reentrant: bool, offload: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=64, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg).train()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    if offload:
        offload_checkpoints(model)
    return model


class _DeviceBytes:
    """Bytes autograd saves outside the offload store, parameters excluded, each storage once; and
    weak references to every decoder layer's input, to see whether anything still keeps it."""

    def __init__(self, model: torch.nn.Module):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: dict[int, int] = {}
        self.inputs: list[weakref.ref] = []
        for layer in model.model.layers:
            layer.register_forward_pre_hook(lambda _m, args: self.inputs.append(weakref.ref(args[0])))

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.params:
            self.seen[ptr] = max(self.seen.get(ptr, 0), t.untyped_storage().nbytes())
        return t


def _step(reentrant: bool, offload: bool) -> dict:
    model = _model(reentrant, offload)
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))
    counter = _DeviceBytes(model)
    with saved_tensors_hooks(counter.pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    gc.collect()
    alive = sum(r() is not None for r in counter.inputs)
    loss.backward()
    store = model.__dict__.get("_shardwise_checkpoint_offload", (None,))[0]
    return {"loss": loss.detach(), "grads": {n: p.grad for n, p in model.named_parameters()},
            "device_bytes": sum(counter.seen.values()), "alive_inputs": alive, "store": store}


@pytest.mark.parametrize("reentrant", [False, True])
def test_offload_is_bit_exact_and_moves_exactly_the_checkpoint_inputs(reentrant):
    plain, off = _step(reentrant, offload=False), _step(reentrant, offload=True)
    assert torch.equal(plain["loss"], off["loss"])
    assert plain["grads"].keys() == off["grads"].keys()
    assert all(torch.equal(g, off["grads"][n]) for n, g in plain["grads"].items())
    inputs = LAYERS * B * S * H * 4  # each layer's input hidden states, fp32
    store = off["store"]
    assert store.packed == LAYERS and store.unpacked == LAYERS and store.packed_bytes == inputs
    assert plain["device_bytes"] - off["device_bytes"] == inputs
    assert plain["alive_inputs"] == LAYERS and off["alive_inputs"] == 0


def test_offload_without_checkpointing_is_refused():
    model = _model(False, offload=True)
    model.activation_checkpointing_disable()
    with pytest.raises(ValueError, match="activation checkpointing is off"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))
    with torch.no_grad():  # evaluation and generate() run without it
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))
