"""Cases for tests/test_pipeline_scripts.py: pipeline scripts as users write them (DeepSpeed's CIFAR example's
shape, a Hugging Face model split by ``pipeline.stages``), bad input, and a stage that dies.

The layers, data and plain-PyTorch references they share with tests/test_pipeline.py are tests/pipeline_cases.py's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pipeline_cases import CONFIG, OUT, WIDTH, Block, Head, batches, specs
from torch import nn


class DictOut(nn.Module):
    """A layer whose output cannot cross to the next stage."""

    def forward(self, x: torch.Tensor) -> dict:
        return {"x": x}


class Unpack(nn.Module):
    def forward(self, x):
        return x["x"] if isinstance(x, dict) else x


def _weight_only(module: nn.Module, x):
    return x @ module.weight.t()


def refusal(kind: str) -> str:
    """Each rank's error line for one kind of bad input (``"none"`` when nothing was raised)."""
    import shardwise
    from shardwise.pipeline import LayerSpec, PipelineModule, TiedLayerSpec

    config = dict(CONFIG)
    layers = specs()
    if kind == "stages":
        layers = layers[:1]
    elif kind == "tied_shapes":
        layers = [TiedLayerSpec("p", nn.Linear, WIDTH, WIDTH), *specs()[1:-1], TiedLayerSpec("p", nn.Linear, WIDTH, 4)]
    elif kind == "output":
        layers = [LayerSpec(Block), LayerSpec(DictOut), LayerSpec(Unpack), LayerSpec(Head, WIDTH, OUT)]
    elif kind == "batch":
        config["train_batch_size"] = 7
    elif kind == "fp16":
        config["fp16"] = {"enabled": True}
    elif kind == "interleaved_v1":
        config["pipeline"] = {"schedule": "interleaved_1f1b"}
    elif kind == "tied_unused":  # the first use reads the tied weight only, the last its bias too
        both = {"tied_weight_attr": ["weight", "bias"]}
        layers = [TiedLayerSpec("p", nn.Linear, WIDTH, WIDTH, forward_fn=_weight_only, **both), *specs()[1:-1],
                  TiedLayerSpec("p", nn.Linear, WIDTH, WIDTH, **both)]
    virtual = {"virtual_1f1b": 2}.get(kind, 1)
    try:
        model = PipelineModule(layers, num_stages=2, loss_fn=F.mse_loss, partition_method="uniform",
                               virtual_stages=virtual)
        engine, *_ = shardwise.initialize(model=model, config=config)
        engine.train_batch(batches(0, 0, config))
    except Exception as e:  # noqa: BLE001 - the line is what is checked
        return f"{type(e).__name__}: {e}"
    return "none"


def tiny_lm(tied: bool) -> nn.Module:
    """A 4-layer Llama built from a config (seeded: the same on every rank)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=tied)
    cfg._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(cfg).train()


def lm_data(step: int, dp_rank: int, gas: int, rows: int = 2) -> list[dict]:
    g = torch.Generator().manual_seed(10 * step + dp_rank)
    return [{"input_ids": torch.randint(0, 64, (rows, 12), generator=g)} for _ in range(gas)]


LM_CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}}


def train_lm(stages: int, tied: bool, steps: int = 3) -> list[float]:
    """An HF Llama split by ``pipeline.stages`` (DeepSpeed's facade: ``deepspeed.initialize``)."""
    import shardwise

    shardwise.install_as_deepspeed()
    import deepspeed

    model = tiny_lm(tied)
    config = {**LM_CONFIG, "pipeline": {"stages": stages}}
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    dp = engine.grid.get_data_parallel_id()
    return [float(engine.train_batch(iter(lm_data(s, dp, 2)))) for s in range(steps)]


def lm_reference(dp: int, tied: bool, steps: int = 3) -> list[float]:
    """The same model trained in one process with HF's own loss (labels = inputs), clipped at a global norm
    of 1.0: DeepSpeed 0.19.8's default for a config without ``gradient_clipping``, which the facade keeps."""
    model = tiny_lm(tied)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    out = []
    for s in range(steps):
        grads, mean = None, torch.zeros(())
        for r in range(dp):
            model.zero_grad()
            total = torch.zeros(())
            for item in lm_data(s, r, 2):
                loss = model(input_ids=item["input_ids"], labels=item["input_ids"]).loss
                (loss * 0.5).backward()
                total += loss.detach()
            g = [p.grad.clone() for p in model.parameters()]
            grads = g if grads is None else [a + b for a, b in zip(grads, g, strict=True)]
            mean += total / 2
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g / dp
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        out.append(float(mean / dp))
    return out


class DieOnRank1(nn.Module):
    """Ends its process (rank 1 only) at its second forward: a stage that dies mid-batch."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import os

        DieOnRank1.calls += 1
        if int(os.environ["RANK"]) == 1 and DieOnRank1.calls == 2:
            os._exit(3)
        return x


def dead_stage(folder: str) -> str:
    """PP 2; stage 1's process dies at its second micro-batch. Stage 0 writes the line it raised to
    ``folder/rank0.txt`` (rank 1 gives no answer) with the seconds it took."""
    import time

    import shardwise
    from shardwise.pipeline import LayerSpec, PipelineModule

    model = PipelineModule([LayerSpec(Block), LayerSpec(Block), LayerSpec(DieOnRank1), LayerSpec(Head, WIDTH, OUT)],
                           num_stages=2, loss_fn=F.mse_loss, partition_method="uniform")
    engine, *_ = shardwise.initialize(model=model, config=CONFIG)
    start = time.monotonic()
    try:
        engine.train_batch(batches(0, 0, CONFIG))
        line = "none"
    except Exception as e:  # noqa: BLE001 - the line is what is checked
        line = f"{type(e).__name__}: {e}"
    with open(f"{folder}/rank0.txt", "w") as f:
        f.write(f"{time.monotonic() - start:.1f}\n{line}")
    return line


def cifar_layers() -> list:
    """DeepSpeed's CIFAR pipeline example's shape: plain modules and a lambda, no specs."""
    torch.manual_seed(7)
    return [nn.Conv2d(3, 4, 3), nn.ReLU(), nn.MaxPool2d(2), lambda x: torch.flatten(x, 1), nn.Linear(4 * 3 * 3, 16),
            nn.ReLU(), nn.Linear(16, 10)]


def cifar_data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(3)
    images = torch.randn(16, 3, 8, 8, generator=g)
    return torch.utils.data.TensorDataset(images, torch.randint(0, 10, (16,), generator=g))


CIFAR_CONFIG = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 2,
                "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "pipeline": {"seed_layers": False}}


def cifar_script(folder: str) -> tuple[list[float], list[str]]:
    """As DeepSpeed's example: args.deepspeed_config, deepspeed.runtime.utils.set_random_seed,
    PipelineModule(layers=..., partition_method=...), initialize(args=..., training_data=...), train_batch()
    with no iterator. Returns the losses and the progress lines (``steps_per_print``) rank 0 printed."""
    import argparse
    import json

    import shardwise

    shardwise.install_as_deepspeed()
    import deepspeed
    from deepspeed.pipe import PipelineModule

    with open(f"{folder}/ds_config.json", "w") as f:
        json.dump(CIFAR_CONFIG, f)
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", f"{folder}/ds_config.json"])
    deepspeed.init_distributed(dist_backend="gloo")
    deepspeed.runtime.utils.set_random_seed(1138)  # as the example; the layers seed their own build
    net = PipelineModule(layers=cifar_layers(), loss_fn=nn.CrossEntropyLoss(), num_stages=2,
                         partition_method="parameters", activation_checkpoint_interval=0)
    engine, _, _, _ = deepspeed.initialize(args=args, model=net, training_data=cifar_data(),
                                           model_parameters=[p for p in net.parameters() if p.requires_grad])
    lines: list[str] = []
    engine.monitor.printer = lines.append
    return [float(engine.train_batch()) for _ in range(5)], lines  # 5 batches of 4 from 16 samples: it repeats


def cifar_reference() -> list[float]:
    layers = cifar_layers()
    params = [p for m in layers if isinstance(m, nn.Module) for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0, fused=True)
    x_all, y_all = cifar_data().tensors
    out = []
    for step in range(5):
        for p in params:
            p.grad = None
        total = torch.zeros(())
        for i in range(2):
            start = (step * 4 + i * 2) % 16
            x, y = x_all[start:start + 2], y_all[start:start + 2]
            for layer in layers:
                x = layer(x)
            loss = nn.CrossEntropyLoss()(x, y)
            (loss * 0.5).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, 1.0)  # DeepSpeed's default without gradient_clipping
        opt.step()
        out.append(float(total / 2))
    return out
