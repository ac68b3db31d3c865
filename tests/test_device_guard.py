"""The CPU-run device guard (tests/device_guard.py, docs/gpu_guard.md): the engine's paths run with
parameters and activations on a second device, on this CPU-only machine, in one process (a fake
world of 2 ranks). A test passes when the path completes: any op mixing the device and the CPU, or
a host read of a ``non_blocking`` device-to-host copy before a fence, raises. The last tests put
each of the three defects of issue 43 back and check the guard fails on it.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from device_guard import DEVICE, HostReadBeforeSync, cuda_reported, device_guard, fake_world
from transformers import AutoModelForCausalLM, LlamaConfig

import shardwise
import shardwise.optim.grad_norm as grad_norm_module
import shardwise.zero.flat_group as flat_group_module

VOCAB, SEQ, MICRO = 61, 8, 2
LR = 1e-3


@pytest.fixture(scope="module", autouse=True)
def world():
    """One fake world of 2 ranks for the module (the sharded paths: rank 0 of 2)."""
    with fake_world(2):
        yield


def tiny_llama() -> torch.nn.Module:
    """Built on the CPU with real values (a fake device cannot run random init), moved by the engine."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=False)
    cfg.attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(cfg).train()


def config(stage: int, precision: str = "fp32", gas: int = 2, clip: float = 1.0, **zero) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
           "train_batch_size": MICRO * gas * 2, "gradient_clipping": clip, "steps_per_print": 0,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 4000, "allgather_bucket_size": 4000,
                                 "stage3_param_persistence_threshold": 0, **zero},  # every stage-3 param sharded
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def train_steps(cfg: dict, steps: int = 1, pin: bool = False) -> tuple:
    """``steps`` optimizer steps of ``gas`` micro-batches each under the guard, then the forward that
    reads the stepped parameters; returns (engine, guard). ``pin``: the pinned-memory branches."""
    model = tiny_llama()
    ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=torch.Generator().manual_seed(1))
    with device_guard() as guard:
        batch = ids.to(DEVICE)
        if pin:
            model.to(DEVICE)
        with cuda_reported() if pin else contextlib.nullcontext():
            engine, *_ = shardwise.initialize(model=model, config=cfg)
        assert next(model.parameters()).device == DEVICE or engine.stage == 3
        for _ in range(steps * cfg["gradient_accumulation_steps"]):
            loss = engine(input_ids=batch, labels=batch).loss
            assert loss.device == DEVICE
            engine.backward(loss)
            engine.step()
        assert engine(input_ids=batch, labels=batch).loss.device == DEVICE
    assert engine.global_steps == steps
    return engine, guard


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stages_on_a_second_device(stage, precision):
    """Every stage and precision: forward, backward (hooks, reduce-scatter), accumulation, clipping, step."""
    engine, guard = train_steps(config(stage, precision))
    assert all(g.flat_param.device == DEVICE for g in engine.groups)
    assert guard.nonblocking_d2h == 0  # nothing leaves the device without offload


@pytest.mark.parametrize("pin", [False, True])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_optimizer(stage, pin):
    """The master on the CPU: gradients copied down non_blocking, fenced before the host reads them."""
    engine, guard = train_steps(config(stage, offload_optimizer={"device": "cpu", "pin_memory": pin}),
                                pin=pin)
    assert all(g.master.device.type == "cpu" for g in engine.groups)
    assert guard.nonblocking_d2h > 0 and guard.syncs >= guard.nonblocking_d2h and not guard.in_flight


@pytest.mark.parametrize("pin", [False, True])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_offload_param(precision, pin):
    """ZeRO-3 with the parameter shards on the CPU (the optimizer steps on them there)."""
    engine, _ = train_steps(config(3, precision, offload_param={"device": "cpu", "pin_memory": pin}),
                            pin=pin)
    assert engine.groups and all(g.param_shard.device.type == "cpu" for g in engine.groups)


def test_offload_param_and_optimizer():
    train_steps(config(3, "bf16", offload_param={"device": "cpu"}, offload_optimizer={"device": "cpu"}))


def test_overlap_comm():
    train_steps(config(2, overlap_comm=True))


@pytest.mark.parametrize("stage", [1, 3])
def test_tensor_parallel(stage):
    """autotp_size 2 over the world of 2 (data-parallel 1): TP's sliced layers and their collectives."""
    cfg = {**config(stage), "tensor_parallel": {"autotp_size": 2}, "train_batch_size": MICRO * 2}
    train_steps(cfg)


def test_generate_at_stage_3():
    """engine.generate at stage 3, the whole model gathered once (unit by unit, synced_gpus loops on a
    float read of the peers' "finished" flag, which fake values never end: not reached)."""
    model = tiny_llama()
    ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=torch.Generator().manual_seed(1))
    with device_guard() as guard:
        guard.finish_after = 6  # fake values never finish a sequence: "finished" after 6 bool reads
        engine, *_ = shardwise.initialize(model=model, config=config(3, gas=1))
        engine.eval()
        batch = ids.to(DEVICE)
        out = engine.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=2, do_sample=False,
                              pad_token_id=0, gather_whole_model=True)
    assert out.device == DEVICE and out.shape[1] > SEQ


# -- the three defects of issue 43, put back one at a time: the guard must fail on each --------------

def _norm_accumulated_on_the_cpu(grads, tp=None, shard=None, squared=False):  # noqa: ARG001
    """Defect (a) as it was: the squares summed into a CPU float64 tensor."""
    sq = torch.zeros(2, dtype=torch.float64)
    for g, tp_slice in grads:
        sq[int(tp_slice)] += torch.linalg.vector_norm(g.detach().float()).double().square()
    if shard is not None and shard.size > 1:
        shard.all_reduce(sq)
    return sq.sum().sqrt()


def test_defect_a_cpu_norm_accumulator_fails(monkeypatch):
    import shardwise.zero.builder as builder

    monkeypatch.setattr(builder, "global_grad_norm", _norm_accumulated_on_the_cpu)
    assert builder.global_grad_norm is _norm_accumulated_on_the_cpu
    with pytest.raises(RuntimeError, match="device"):
        train_steps(config(2))


def _attach_as_before(self, scale: float):
    """Defects (b) and (c) as they were: the device grad assigned to a CPU master view (offload_param),
    and a non_blocking device-to-host copy scaled on the host at once (offload_optimizer)."""
    g = self.owned_grad()
    if self.master_is_view:
        g.mul_(scale)
        self.master.grad = g
    else:
        mg = g.to(device=self.master.device, dtype=self.master.dtype, non_blocking=True)
        self.master.grad = mg.mul_(scale)
    return self.master.grad


def test_defect_b_device_grad_on_cpu_master_fails(monkeypatch):
    monkeypatch.setattr(flat_group_module.ShardedGroup, "attach_master_grad", _attach_as_before)
    with pytest.raises(RuntimeError, match="device"):
        train_steps(config(3, offload_param={"device": "cpu"}))


def test_defect_c_unfenced_host_read_fails(monkeypatch):
    monkeypatch.setattr(flat_group_module.ShardedGroup, "attach_master_grad", _attach_as_before)
    with pytest.raises(HostReadBeforeSync, match="non_blocking device-to-host copy"):
        train_steps(config(2, offload_optimizer={"device": "cpu"}))


def test_guard_sees_a_plain_mix():
    """The mechanism itself: a CPU tensor meeting a device tensor raises, a CPU scalar does not (as CUDA)."""
    with device_guard():
        x = torch.ones(3, device=DEVICE)
        with pytest.raises(RuntimeError, match="device"):
            x + torch.ones(3)
        assert (x + torch.tensor(2.0)).device == DEVICE
    assert grad_norm_module.global_grad_norm is not _norm_accumulated_on_the_cpu
