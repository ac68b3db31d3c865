"""The CPU-run device guard (tests/device_guard.py) on ``shardwise train --pp``'s path: the model built under
``stage_init`` (this stage's parameters made real, then moved by the engine), a step of ``train_batch``, the
eval and probe forwards, the sample decoded through the stages and the stage's shard of the ``hf/`` export.

The fake group carries no bytes between stages, so the one stage this process plays (rank 0: the first, rank
1: the last of two) receives, in place of its neighbour's transfers, device tensors of the shapes the
neighbour would send; everything else (its layers, its loss, its gradients, the broadcasts of the loss and of
the decoded tokens, the norm's all-reduce) runs as on a device."""

from __future__ import annotations

import json

import pytest
import torch
from device_guard import DEVICE, device_guard, fake_world
from test_device_guard import MICRO, SEQ, VOCAB, tiny_llama
from torch._subclasses.fake_tensor import unset_fake_temporarily

from shardwise.pipeline import hf, wire

HIDDEN, PROMPT = 32, 4
CFG = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 2, "steps_per_print": 0,
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1},
       "pipeline": {"stages": 2}}


def _neighbour(self, peer, what, device, label=None):  # noqa: ANN001 - Link.recv's signature
    """What the other stage would send: activations / their gradients [micro, seq, hidden], or the decode's
    hidden states [1, prompt or 1, hidden]."""
    if "decode" in what:
        length = PROMPT if what.endswith("position 0") else 1
        return (torch.zeros(1, length, HIDDEN, device=device),)
    return (torch.zeros(MICRO, SEQ, HIDDEN, device=device),)


def _outside_fake(fn, *args):  # noqa: ANN001
    with unset_fake_temporarily():
        return fn(*args)


@pytest.mark.parametrize("rank", [0, 1], ids=["first-stage", "last-stage"])
def test_train_pp_stage_on_the_device(monkeypatch, tmp_path, rank: int) -> None:
    from safetensors import torch as st

    from shardwise.train import loop, pipeline_job

    written: dict = {}

    def save_file(tensors, path, metadata=None):  # noqa: ANN001 - safetensors' signature
        written.update({k: v.device for k, v in tensors.items()})  # the writer is handed host tensors
        open(path, "wb").close()

    real = hf.materialize_stage
    # the stage's values are made on the host (the CPU generator's draws, a folder's bytes): real there, then
    # moved by the engine, whose placement the guard checks
    monkeypatch.setattr(hf, "materialize_stage", lambda *a: _outside_fake(real, *a))
    monkeypatch.setattr(wire.Link, "recv", _neighbour)
    monkeypatch.setattr(pipeline_job, "make_comm", _ObjectsEcho)
    monkeypatch.setattr(st, "save_file", save_file)
    monkeypatch.setattr(pipeline_job, "_write_index", lambda tmp, *a: (tmp / "config.json").write_text(json.dumps({})))
    if rank == 1:
        (tmp_path / "hf.tmp").mkdir()  # made by rank 0, which renames it once every stage's shard is in
    with fake_world(2, rank=rank):
        with pipeline_job.building(CFG):
            model = tiny_llama()
        assert all(p.is_meta for p in model.parameters())
        ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=torch.Generator().manual_seed(1))
        with device_guard() as guard:
            import shardwise

            # the decode's host reads: the prompt's mask all ones, rows left, the last stage's flag not "stopped"
            guard.answers["pipeline/generate.py"] = (1, True)
            engine, *_ = shardwise.initialize(model=model, config=CFG)
            batch = ids.to(DEVICE)
            loss, norm = pipeline_job.train_batch(engine, [batch, batch])
            sums = pipeline_job.eval_sums(engine, [batch])
            probe = pipeline_job.probe(engine, batch)  # the neighbour sends micro-batches of MICRO rows
            text = loop.sample(pipeline_job.staged(engine, model), _Tokens(), list(range(PROMPT)), 2, 0)
            pipeline_job.save_hf(engine, model, tmp_path / "hf")
    assert engine.stage_id == rank and engine.global_steps == 1 and norm is None
    assert isinstance(loss, float) and isinstance(probe, float) and sums.device == DEVICE and isinstance(text, str)
    assert written and set(written.values()) == {torch.device("cpu")}
    assert (tmp_path / ("hf" if rank == 0 else "hf.tmp") / f"model-0000{rank + 1}-of-00002.safetensors").is_file()
    assert not guard.in_flight


class _ObjectsEcho:
    """The world's comm for the export's small objects (the fake group carries no bytes): every rank's
    answer is this one's."""

    def barrier(self) -> None:
        pass

    def all_gather_object(self, out: list, obj) -> None:  # noqa: ANN001
        out[:] = [obj] * len(out)


class _Tokens:
    eos_token_id = None

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))
