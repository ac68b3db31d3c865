"""The CPU-run device guard (tests/device_guard.py, docs/gpu_guard.md) on the paths beyond the engine
step of tests/test_device_guard.py: the low-precision masters, ZeRO-Inference, expert and sequence
parallelism, the ``fully_shard`` API, checkpoint I/O and the ``train`` loop. A test passes when the
path completes with every tensor on its device; a proof test beside a path puts a defect back and
checks the guard fails on it.
"""

from __future__ import annotations

import pytest
import torch
from device_guard import DEVICE, HostReadBeforeSync, StreamOrderError, device_guard, fake_world
from test_device_guard import MICRO, SEQ, VOCAB, config, tiny_llama, train_steps

import shardwise.zero.low_precision as low_precision


@pytest.fixture
def world2():
    """A fake world of 2 ranks (the sharded paths: rank 0 of 2)."""
    with fake_world(2):
        yield


@pytest.fixture
def world1():
    """A fake world of 1 (ZeRO-Inference streams on one rank; at 2 ranks ``generate``'s synced
    loop waits on the peers' "finished" flag, which fake values never end)."""
    with fake_world(1):
        yield


def low_precision_config(stage: int, update: str, **zero) -> dict:
    cfg = config(stage, "bf16", **zero)
    cfg["bf16"]["bf16_master_weights_and_grads"] = True
    cfg["shardwise"] = {"master_update": update}
    return cfg


@pytest.mark.parametrize("update", ["kahan", "stochastic", "nearest"])
def test_low_precision_masters(world2, update):
    """bf16 masters stepped through the fp32 window (zero/low_precision.py); the stochastic rounding's
    generator is made on the master's device (the guard checks every random op's generator)."""
    engine, _ = train_steps(low_precision_config(2, update))
    assert all(g.master.dtype == torch.bfloat16 and g.master.device == DEVICE for g in engine.groups)


def test_low_precision_offloaded_stochastic(world2):
    """The same window on a CPU master (ZeRO-3, offload_optimizer): a CPU generator there."""
    engine, guard = train_steps(low_precision_config(3, "stochastic", offload_optimizer={"device": "cpu"}))
    assert all(g.master.device.type == "cpu" for g in engine.groups)
    assert guard.nonblocking_d2h > 0 and not guard.in_flight


def test_cpu_generator_for_device_master_fails(world2, monkeypatch):
    """Proof: a CPU generator drawing the noise of a device master (what ``torch.Generator()`` without
    ``device=`` would do) fails under the guard, as CUDA refuses it."""
    rounding = low_precision.round_stochastic
    monkeypatch.setattr(low_precision, "round_stochastic", lambda x, gen: rounding(x, torch.Generator()))
    with pytest.raises(RuntimeError, match="device type for generator"):
        train_steps(low_precision_config(2, "stochastic"))


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> str:
    """The tiny Llama saved as a ``save_pretrained`` folder (what ZeRO-Inference streams from)."""
    folder = tmp_path_factory.mktemp("guard_model")
    tiny_llama().eval().save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize(("offload", "quantize", "prefetch"), [
    ("cpu", None, 1), ("disk", None, 0), ("cpu", "int8", 0), ("cpu", "int4", 0), (None, None, 1)])
def test_zero_inference(world1, model_folder, offload, quantize, prefetch):
    """``init_inference`` + ``generate``: the decoder layers gathered from (pinned) CPU shards, from the
    files, or dequantized from the quantized store, into device buffers. A read from the files on the
    reader thread (prefetch with a FileStore) is not run: fake tensors are not thread-safe (a fake-mode
    assertion, ``in_kernel_invocation``, fails at random), so those cases read in line."""
    from shardwise.inference.load import init_inference
    from shardwise.inference.quantized_linear import native_block_rows

    native_block_rows()  # the torch build's int4 packing, probed once on real CPU tensors (cached)
    ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=torch.Generator().manual_seed(1))
    with device_guard() as guard:
        guard.finish_after = 6  # fake values never finish a sequence: "finished" after 6 bool reads
        model = init_inference(model_folder, offload=offload, quantize=quantize, prefetch=prefetch,
                               dtype=torch.float32)
        batch = ids.to(DEVICE)
        out = model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=2, do_sample=False,
                             pad_token_id=0)
    assert out.device == DEVICE and out.shape[1] > SEQ
    assert not guard.in_flight


@pytest.mark.parametrize(("stage", "attention", "tiles"), [(1, None, None), (3, None, 2), (2, "ring", None)])
def test_sequence_parallel(world2, monkeypatch, stage, attention, tiles):
    """SP 2 over the world of 2: Ulysses (stage 1), Ulysses with ALST's tiled MLPs and tiled loss
    (stage 3), ring attention (stage 2); forward, loss, backward, step. ``split_batch`` runs on the
    CPU batch first (it decides from the mask's values), and the shard-length check's reads answer 0
    (equal lengths, no layout problem): its tensor and all-reduce still run on the device."""
    import sp_cases

    import shardwise
    import shardwise.sequence_parallel.attention as sp_attention
    from shardwise.sequence_parallel import sequence_parallel_loss, split_batch, tile_mlps, tiled_causal_lm_loss

    monkeypatch.setattr(sp_attention, "_MASK", {})  # the causal-mask cache: this run's fake tensors only
    model = sp_cases.llama(impl="eager")  # sdpa: HF builds a mask from fake values, which SP refuses
    if tiles:
        tile_mlps(model, tiles)
    cfg = sp_cases.sp_config(stage, 2, 2)
    if attention:
        cfg["shardwise"] = {"sequence_parallel_attention": attention}
    batch = sp_cases.sample_batch(2, 16)
    with device_guard() as guard:
        guard.answers["sequence_parallel/attention.py"] = 0
        engine, *_ = shardwise.initialize(model=model, config=cfg)
        sp = engine.sequence_parallel
        shard = {k: v.to(DEVICE) for k, v in split_batch(batch, sp).items()}
        labels = shard.pop("shift_labels")
        if tiles:
            loss = tiled_causal_lm_loss(engine, shard, labels, sp, tiles=tiles)
        else:
            loss = sequence_parallel_loss(engine(**shard).logits, labels, sp)
        assert loss.device == DEVICE
        engine.backward(loss)
        engine.step()
    assert engine.global_steps == 1 and sp.size == 2
    # the length check read its all-reduced lengths (at stage 3 inside ZeRO's torch-function wrapper)
    where = ("sequence_parallel/attention.py", "zero/stage3/external.py")
    assert any(k in line for line in guard.host_syncs for k in where)


@pytest.mark.parametrize(("stage", "precision", "offload"), [(3, None, None), (2, torch.bfloat16, "optimizer"),
                                                             (3, torch.bfloat16, "all")])
def test_fully_shard_api(world2, stage, precision, offload):
    """``shardwise.shard`` + ``ShardedOptimizer`` + ``clip_grad_norm_`` (the FSDP2-style front end):
    the returned norm is on the device of the gradients it measured, as torch's (the CPU master grads
    under optimizer offload, as FSDP2's with its CPU offload policy)."""
    import shardwise

    model = tiny_llama()
    ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=torch.Generator().manual_seed(1))
    with device_guard() as guard:
        model = shardwise.shard(model, stage=stage, mixed_precision=precision, offload=offload, bucket_size=4000,
                                persistence_threshold=0)
        opt = shardwise.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-3)
        batch = ids.to(DEVICE)
        model(input_ids=batch, labels=batch).loss.backward()
        norm = shardwise.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
        assert norm.device == (DEVICE if offload is None else torch.device("cpu"))
        assert model(input_ids=batch, labels=batch).loss.device == DEVICE
    assert not guard.in_flight


def _outside_the_fake_mode(monkeypatch, fn) -> None:
    """``fn`` (host-only bytes: the RNG states a checkpoint keeps) run on real tensors, in every module
    that binds it: fake tensors have no bytes for a generator to restore."""
    import sys

    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def run(*args, **kwargs):
        with unset_fake_temporarily():
            return fn(*args, **kwargs)

    for mod in [m for n, m in list(sys.modules.items()) if n.startswith("shardwise") and m is not None]:
        if getattr(mod, fn.__name__, None) is fn:
            monkeypatch.setattr(mod, fn.__name__, run)


def checkpoint_round_trip(monkeypatch, tmp_path, zero: dict) -> None:
    """Save, load twice, save the 16-bit model, step (see :func:`test_checkpoint_save_load_16bit`)."""
    import shardwise
    import shardwise.checkpoint.load  # noqa: F401  (binds rng_setter: patched below)
    import shardwise.checkpoint.save  # noqa: F401
    from shardwise.checkpoint import fileio, wait_for_checkpoint

    _outside_the_fake_mode(monkeypatch, fileio.rng_state)
    _outside_the_fake_mode(monkeypatch, fileio.rng_setter)
    # the I/O engine moves bytes between host buffers and files, and a fake tensor has no bytes (its
    # .numpy() is a fresh array of zeros): the guard runs the buffered writer and first-use hashing
    from shardwise.checkpoint import load_plan, shard_writer

    monkeypatch.setattr(shard_writer, "ENGINE", False)
    monkeypatch.setattr(load_plan, "AHEAD", False)
    model, again = tiny_llama(), tiny_llama()
    ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=torch.Generator().manual_seed(1))
    zero = dict(zero)
    stage = zero.pop("stage")
    cfg = {**config(stage, gas=1, **zero), "train_batch_size": MICRO}
    with device_guard() as guard:
        engine, *_ = shardwise.initialize(model=model, config=cfg)
        batch = ids.to(DEVICE)
        engine.backward(engine(input_ids=batch, labels=batch).loss)
        engine.step()
        engine.save_checkpoint(tmp_path, tag="t")
        engine.save_checkpoint(tmp_path / "async", tag="t", asynchronous=True)  # staged: non_blocking + event
        wait_for_checkpoint()
        path, _ = engine.load_checkpoint(tmp_path, tag="t")
        engine.save_16bit_model(tmp_path / "hf")
        assert engine(input_ids=batch, labels=batch).loss.device == DEVICE
        fresh, *_ = shardwise.initialize(model=again, config=cfg)
        fresh.load_checkpoint(tmp_path, tag="t")
        fresh.backward(fresh(input_ids=batch, labels=batch).loss)
        fresh.step()
    assert path is not None and (tmp_path / "t").is_dir() and any((tmp_path / "hf").iterdir())
    assert not guard.in_flight


@pytest.mark.parametrize("zero", [{"stage": 2}, {"stage": 3, "offload_optimizer": {"device": "cpu"}},
                                  {"stage": 3, "offload_param": {"device": "cpu"}}],
                         ids=["stage2", "stage3-offload-optimizer", "stage3-offload-param"])
def test_checkpoint_save_load_16bit(world1, monkeypatch, tmp_path, zero):
    """save_checkpoint, load_checkpoint (into the stepped engine: offloaded masters, the publish fence;
    and into a fresh one, which holds no optimizer state yet), save_16bit_model, then a forward.

    In a world of 1: a save in a world of 2 waits for rank 1's files, which this one process never
    writes. Writing takes a fake tensor's bytes as zeros (``.numpy()`` of a device tensor is refused,
    as CUDA refuses it); reading skips the bytes (``read_into``)."""
    checkpoint_round_trip(monkeypatch, tmp_path, zero)



def test_train_loop(world2, tmp_path):
    """One step of ``shardwise train``'s loop (``train/loop.py``: micro-batches moved to the device,
    the loss and stop flag all-reduced), its eval and probe forwards, the weights' divergence check,
    with the csv monitor on (the step's values reduced and logged). Checkpointing within the loop is
    the checkpoint test above (a world of 1)."""
    import numpy as np

    import shardwise
    from shardwise.train import loop
    from shardwise.train.data import TokenData
    from shardwise.train.divergence import NonFiniteGuard

    tokens = np.random.default_rng(0).integers(0, VOCAB, 12 * SEQ).astype(np.int64)
    data = TokenData(tokens, SEQ, n_train=10, n_eval=2, seed=0)
    cfg = {**config(2), "steps_per_print": 1,
           "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "guard"}}
    model = tiny_llama()
    with device_guard() as guard:
        guard.answers["train/divergence.py"] = (0, True)  # finite weights: each within range, no rank flagged
        engine, *_ = shardwise.initialize(model=model, config=cfg)
        result = loop.train_step(engine, data, 0, loop.StopRequest())
        eval_loss = loop.evaluate(engine, data)
        probe = loop.probe_loss(engine, data)
        NonFiniteGuard(0).check_weights(engine, 1, "the checkpoint")
    assert engine.global_steps == 1 and not result.stopped
    assert all(isinstance(v, float) for v in (result.loss, eval_loss, probe))
    assert any(tmp_path.rglob("*.csv"))  # the monitor wrote the step's values
    assert not guard.in_flight


def _wait_without_the_event(self):
    """``GradToHost.wait`` with its event's synchronize left out (the side stream's copy not fenced)."""
    self._copied, self._source = None, None
    return self.buffer


@pytest.mark.parametrize("stage", [2, 3])
def test_side_stream_copy_unfenced_fails(world2, monkeypatch, stage):
    """Proof for the offload side stream (``zero/host_copy.py GradToHost``): its copy is queued on the
    side stream under ``with stream:`` and fenced by an event; the host reading the buffer without
    that event's synchronize fails under the guard."""
    from shardwise.zero.host_copy import GradToHost

    monkeypatch.setattr(GradToHost, "wait", _wait_without_the_event)
    with pytest.raises(HostReadBeforeSync, match="non_blocking device-to-host copy"):
        train_steps(config(stage, offload_optimizer={"device": "cpu"}))


def test_zero_inference_prefetch_on_the_copy_stream(world1, model_folder, monkeypatch):
    """``offload="cpu"`` with prefetch: each read-ahead layer's copy is queued on the side copy stream
    (``host_copy.copy_ahead``, a ``CopyAhead`` the gather waits for on the device), the layer needed
    now on the compute stream; every tensor on its device. (Stream order is not modelled by the guard:
    the copy stream waiting for the compute stream, and the compute stream for the copy's event,
    are read in the code, not checked here.)"""
    import shardwise.zero.store as store
    from shardwise.inference.load import init_inference
    from shardwise.zero.host_copy import CopyAhead

    queued = []

    def counted(dst, src):
        out = ahead(dst, src)
        queued.append(out)
        return out

    ahead = store.copy_ahead
    monkeypatch.setattr(store, "copy_ahead", counted)
    ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=torch.Generator().manual_seed(1))
    with device_guard() as guard:
        guard.finish_after = 6
        model = init_inference(model_folder, offload="cpu", prefetch=1, dtype=torch.float32)
        batch = ids.to(DEVICE)
        out = model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=2, do_sample=False,
                             pad_token_id=0)
    assert out.device == DEVICE
    assert queued and all(isinstance(w, CopyAhead) and w.device == DEVICE for w in queued)


def test_prefetch_used_before_its_copy_fails(world1, model_folder, monkeypatch):
    """Proof for the copy stream: a prefetched layer used without the compute stream waiting for its
    copy's event (``CopyAhead.wait`` a no-op) fails under the guard (``StreamOrderError``)."""
    from shardwise.inference.load import init_inference
    from shardwise.zero.host_copy import CopyAhead

    monkeypatch.setattr(CopyAhead, "wait", lambda self: None)
    ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=torch.Generator().manual_seed(1))
    with pytest.raises(StreamOrderError, match="before waiting for that stream"), device_guard() as guard:
        guard.finish_after = 6
        model = init_inference(model_folder, offload="cpu", prefetch=1, dtype=torch.float32)
        batch = ids.to(DEVICE)
        model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=2, do_sample=False,
                       pad_token_id=0)


@pytest.mark.parametrize(("zero", "schedule"), [(0, "1f1b"), (3, "1f1b"), (3, "zb_h1")])
def test_pipeline_engine_one_stage(world2, zero: int, schedule: str):
    """A PipelineModule at 1 stage x DP 2 (the fake group cannot carry sends between stages): its batches
    moved to the device, the stage's loss and the averaged loss made there, and eval_batch; at ZeRO-3 the
    gradients accumulated in the local buckets and reduce-scattered once, the stage held gathered; under
    zb_h1 the backward split in two (pipeline/split.py: the weight pass from the loss's gradient)."""
    import pipeline_cases as pc
    import torch.nn.functional as F

    import shardwise
    from shardwise.pipeline import PipelineModule

    model = PipelineModule(pc.specs(), num_stages=1, loss_fn=F.mse_loss)
    config = {**pc.CONFIG, "zero_optimization": {"stage": zero, "stage3_param_persistence_threshold": 0},
              "pipeline": {"schedule": schedule}}
    with device_guard():
        engine, *_ = shardwise.initialize(model=model, config=config)
        loss = engine.train_batch(pc.batches(0, 0, pc.CONFIG))
        assert loss.device == DEVICE and engine.eval_batch(pc.batches(1, 0, pc.CONFIG)).device == DEVICE
    assert engine.global_steps == 1 and engine.reduce_once == (zero == 3)


@pytest.mark.parametrize("kind", ["tp", "sp"])
def test_pipeline_engine_one_stage_with_tp_or_sp(world2, kind: str):
    """A PipelineModule at 1 stage x TP 2 (DeepSpeed's 3D topology, Megatron-marked slices) or x SP 2 (layers
    exchanging over the grid's SP group): the grid's groups from the run layout, the sequence shards and the
    TP partial sums on the device (tests/pipeline_compose_cases.py)."""
    import pipeline_compose_cases as pcc
    import torch.nn.functional as F

    import shardwise
    from shardwise.pipeline import PipelineModule, PipeModelDataParallelTopology

    tp = 2 if kind == "tp" else 1
    topology = PipeModelDataParallelTopology(num_pp=1, num_mp=tp, num_dp=2 // tp)
    config = {**pcc.CONFIG, **({"sequence_parallel_size": 2} if kind == "sp" else {})}
    model = PipelineModule(pcc.specs(kind), topology=topology, loss_fn=F.mse_loss)
    with device_guard():
        engine, *_ = shardwise.initialize(model=model, config=config)
        items = iter([pcc.data(0, 0, i, 2, 0, 2 if kind == "sp" else 1) for i in range(4)])
        assert engine.train_batch(items).device == DEVICE
    assert engine.global_steps == 1 and engine.layout.tp == tp
