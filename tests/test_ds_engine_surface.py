"""Every public DeepSpeedEngine method (DeepSpeed 0.19, shardwise/engine/ds_surface.py) is served
by shardwise's engine or refused with DeepSpeedNameNotImplemented naming it, never a bare
AttributeError; the batch-size setters and module_state_dict behave as DeepSpeed's."""

from __future__ import annotations

import pytest
import torch

import shardwise
from shardwise.deepspeed import DeepSpeedNameNotImplemented
from shardwise.engine.ds_surface import DEEPSPEED_ENGINE_METHODS


@pytest.fixture
def engine():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[1].weight.requires_grad_(False)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 1}}
    eng, *_ = shardwise.initialize(model=model, config=cfg, model_parameters=model.parameters())
    return eng


def test_every_deepspeed_engine_method_is_served_or_refused_by_name(engine):
    served, refused = [], []
    for name in DEEPSPEED_ENGINE_METHODS:
        try:
            getattr(engine, name)
            served.append(name)
        except DeepSpeedNameNotImplemented as err:
            assert f"DeepSpeedEngine.{name}" in str(err) and isinstance(err, AttributeError)
            assert not hasattr(engine, name)  # hasattr / getattr(default) still say "absent"
            refused.append(name)
    assert len(DEEPSPEED_ENGINE_METHODS) == 201 and len(served) + len(refused) == 201
    assert {"module_state_dict", "set_train_batch_size", "get_batch_info"} <= set(served)
    assert "pld_enabled" in refused  # progressive layer drop: refused by name
    with pytest.raises(AttributeError) as err:
        engine.no_such_method  # noqa: B018 - not a DeepSpeed name: the plain error
    assert not isinstance(err.value, DeepSpeedNameNotImplemented)


def test_batch_setters(engine):
    assert engine.get_batch_info() == (2, 2, 1)
    engine.set_train_batch_size(6)
    assert engine.get_batch_info() == (6, 2, 3) and engine.gradient_accumulation_steps() == 3
    x = torch.ones(2, 4)
    bounds = []
    for _ in range(6):
        bounds.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(x).sum())
        engine.step()
    assert bounds == [False, False, True] * 2 and engine.global_steps == 2
    with pytest.raises(ValueError, match="multiple"):
        engine.set_train_batch_size(5)
    engine.set_train_micro_batch_size(1)
    assert engine.get_batch_info() == (3, 1, 3)


def test_module_state_dict(engine):
    full = engine.module_state_dict()
    assert full.keys() == engine.module.state_dict().keys()
    assert all(torch.equal(full[k], v) for k, v in engine.module.state_dict().items())
    assert "1.weight" not in engine.module_state_dict(exclude_frozen_parameters=True)


def test_what_the_engine_returns_is_deepspeeds(tmp_path):
    """The return types of what scripts call, against DeepSpeed 0.19.8's (docs/deepspeed_api.md, "What
    the facade returns"): ``initialize``'s 4-tuple, ``backward``'s ``loss / gas``, ``step``'s None, a
    float gradient norm, lists from ``get_lr`` / ``get_mom``, bools and ints from the accessors,
    ``save_16bit_model``'s True, ``load_checkpoint``'s ``(path, client_state)`` and ``(None, None)`` for
    a folder without a checkpoint. Deliberate differences: ``save_checkpoint`` returns the checkpoint's
    path (truthy, as DeepSpeed's True) rather than True; a folder that does not exist is refused in one
    line (DeepSpeed returns ``(None, None)``: a mistyped path would train from scratch, silently)."""
    import tiny_models

    model = tiny_models.build("llama")
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}}
    out = shardwise.initialize(model=model, config=cfg)
    assert isinstance(out, tuple) and len(out) == 4
    engine, optimizer, loader, scheduler = out
    assert optimizer is engine.optimizer and loader is None and scheduler is None
    ids = torch.arange(8).reshape(1, 8)
    for micro in range(2):
        loss = engine(input_ids=ids, labels=ids).loss
        assert engine.is_gradient_accumulation_boundary() is (micro == 1)
        scaled = engine.backward(loss)
        assert isinstance(scaled, torch.Tensor) and torch.equal(scaled, loss / 2)
        assert engine.step() is None
    assert type(engine.get_global_grad_norm()) is float and engine.was_step_applied() is True
    assert isinstance(engine.get_lr(), list) and all(type(x) is float for x in engine.get_lr())
    assert engine.get_mom() == [(0.9, 0.999)]
    assert all(type(f()) is int for f in (engine.train_batch_size, engine.train_micro_batch_size_per_gpu,
                                          engine.gradient_accumulation_steps, engine.zero_optimization_stage))
    assert engine.get_batch_info() == (2, 1, 2) and engine.config.get("zero_optimization").get("stage") == 2
    assert engine.save_16bit_model(str(tmp_path / "hf")) is True
    path = engine.save_checkpoint(str(tmp_path / "ckpt"), client_state={"epoch": 3})
    assert isinstance(path, str) and path
    loaded, client = engine.load_checkpoint(str(tmp_path / "ckpt"))
    assert isinstance(loaded, str) and client["epoch"] == 3
    (tmp_path / "empty").mkdir()
    assert engine.load_checkpoint(str(tmp_path / "empty")) == (None, None)
    with pytest.raises(RuntimeError, match="no such checkpoint folder"):  # DeepSpeed warns and returns (None, None)
        engine.load_checkpoint(str(tmp_path / "typo"))
