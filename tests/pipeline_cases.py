"""Cases for tests/test_pipeline.py: a DeepSpeed-style PipelineModule script on the pool's ranks, and the
same layers trained in one process with plain PyTorch (the reference).

The model: ``LAYERS`` blocks (Linear + tanh) and a head; with ``tied`` the first layer is a square
projection whose weight the last layer reuses (``TiedLayerSpec``, ``forward_fn`` = x @ W). Every layer
is seeded by its index (``seed_layers=True``), so its initial weights do not depend on the stages.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

WIDTH, OUT, LAYERS, BASE_SEED = 8, 8, 6, 1234
CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}}


class Block(nn.Module):
    def __init__(self, width: int = WIDTH):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class Head(nn.Linear):
    pass


def tied_head(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x @ module.weight


class Split(nn.Module):
    """Hands the next layers a tuple: the activations, an integer mask and a float tensor that needs no grad."""

    def forward(self, x: torch.Tensor) -> tuple:
        return x, (x > 0).long(), torch.full_like(x, 0.5)


class TupleBlock(Block):
    def forward(self, inputs: tuple) -> tuple:
        x, mask, half = inputs
        return torch.tanh(self.fc(x)) * (1 + mask * half), mask, half


class Merge(nn.Module):
    def forward(self, inputs: tuple) -> torch.Tensor:
        return inputs[0]


def specs(tied: bool | str = False, api=None) -> list:
    """The layers; ``api``: the module providing LayerSpec / TiedLayerSpec (DeepSpeed's for the fixture).
    ``tied="tuple"``: tuples cross the stage boundaries instead (tensors with and without gradients);
    ``tied="three"``: one weight used by three layers (0, 5 and 7 of 8)."""
    if api is None:
        from shardwise import pipeline as api
    LayerSpec, TiedLayerSpec = api.LayerSpec, api.TiedLayerSpec  # noqa: N806
    if tied == "tuple":
        return [LayerSpec(Block), LayerSpec(Split), *[LayerSpec(TupleBlock) for _ in range(4)], LayerSpec(Merge),
                LayerSpec(Head, WIDTH, OUT)]
    if tied == "three":  # three uses: the first layer, one in the middle, the head (forward_fn = x @ W)
        use = TiedLayerSpec("proj", nn.Linear, WIDTH, WIDTH, bias=False, forward_fn=tied_head)
        return [TiedLayerSpec("proj", nn.Linear, WIDTH, WIDTH, bias=False), *[LayerSpec(Block) for _ in range(4)],
                use, LayerSpec(Block), use]
    first = [TiedLayerSpec("proj", nn.Linear, WIDTH, WIDTH, bias=False)] if tied else []
    last = ([TiedLayerSpec("proj", nn.Linear, WIDTH, WIDTH, bias=False, forward_fn=tied_head)] if tied
            else [LayerSpec(Head, WIDTH, OUT)])
    return first + [LayerSpec(Block) for _ in range(LAYERS)] + last


def data(step: int, dp_rank: int, micro: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 100 * dp_rank + micro)
    return torch.randn(rows, WIDTH, generator=g), torch.randn(rows, OUT, generator=g)


def batches(step: int, dp_rank: int, config: dict):
    for i in range(config["gradient_accumulation_steps"]):
        yield data(step, dp_rank, i, config["train_micro_batch_size_per_gpu"])


def train(stages: int, config: dict | None = None, steps: int = 3, tied: bool | str = False,
          partition: str = "parameters", interval: int = 0, facade: bool = False, reduce_once: bool = True,
          virtual: int = 1, tied_exact: bool = True) -> dict:
    """Each rank: the losses train_batch returned and its stage's final weights by layer index.
    ``facade``: written as a DeepSpeed script (``import deepspeed``, ``deepspeed.pipe``). ``reduce_once=False``:
    ZeRO-2/3 reduce-scatter after every micro-batch instead of once per batch. ``virtual``: chunks per rank.
    ``tied_exact=False``: tied gradients sent once a batch (DeepSpeed's order), not per micro-batch."""
    import shardwise

    if facade:
        shardwise.install_as_deepspeed()
        import deepspeed
        import deepspeed.pipe as api

        deepspeed.init_distributed()
        initialize = deepspeed.initialize
    else:
        from shardwise import pipeline as api

        initialize = shardwise.initialize
    config = {**CONFIG, **(config or {})}
    model = api.PipelineModule(specs(tied, api), num_stages=stages, loss_fn=F.mse_loss, seed_layers=True,
                               seed_fn=torch.manual_seed, base_seed=BASE_SEED, partition_method=partition,
                               activation_checkpoint_interval=interval,
                               **({"virtual_stages": virtual} if virtual > 1 else {}))
    engine, _, _, _ = initialize(model=model, config=config,
                                 model_parameters=[p for p in model.parameters() if p.requires_grad])
    engine.set_reduce_once(reduce_once)
    engine.set_tied_exact(tied_exact)
    dp_rank = engine.grid.get_data_parallel_id()
    if config.get("bf16", {}).get("enabled"):  # the script hands the model bf16 inputs, as DeepSpeed's must
        engine.set_batch_fn(lambda b: tuple(t.bfloat16() for t in b))
    losses = [engine.train_batch(batches(s, dp_rank, config)).item() for s in range(steps)]
    calls = {k: engine.layout.stats.calls.get(k, 0) for k in ("reduce_scatter", "all_gather")}  # training's only
    evaluated = engine.eval_batch(batches(steps, dp_rank, config)).item()
    engine.wait_for_params()
    with shardwise.zero.GatheredParameters(list(model.parameters())):
        weights = {f"{k}": v.detach().clone() for k, v in model.state_dict().items()}
    stats = engine.comm_stats()
    return {"losses": losses, "eval": evaluated, "weights": weights, "parts": model.parts, "stage": engine.stage_id,
            "first": engine.is_first_stage(), "last": engine.is_last_stage(),
            "send": stats.get("send", 0), "recv": stats.get("recv", 0), "calls": calls,
            "groups": len(engine.sharding.groups)}


def reference(dp: int | list[int], config: dict | None = None, steps: int = 3, tied: bool | str = False) -> dict:
    """Plain PyTorch in one process: the same layers, micro-batches, accumulation and AdamW. ``dp``: the
    data-parallel replicas, or a list of them by step (a run resumed at another layout)."""
    config = {**CONFIG, **(config or {})}
    built: dict = {}
    layers = []
    for idx, spec in enumerate(specs(tied)):
        torch.manual_seed(BASE_SEED + idx)
        key = getattr(spec, "key", None)
        if key is not None and key in built:
            layers.append((built[key], spec.forward_fn))
            continue
        module = spec.build()
        built[key] = module
        layers.append((module, getattr(spec, "forward_fn", None)))
    params = list(dict.fromkeys(p for m, _ in layers for p in m.parameters()))
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, fused=True)  # the engine builds the fused kernel
    gas = config["gradient_accumulation_steps"]
    out = []
    per_step = dp if isinstance(dp, list) else [dp] * steps
    for step in range(steps):
        summed, mean, dp = None, torch.zeros(()), per_step[step]
        for r in range(dp):
            for p in params:
                p.grad = None
            total = torch.zeros(())
            for x, y in batches(step, r, config):
                for m, fn in layers:
                    x = m(x) if fn is None else fn(m, x)
                loss = F.mse_loss(x, y)
                (loss * (1.0 / gas)).backward()
                total += loss.detach()
            grads = [p.grad.clone() for p in params]
            summed = grads if summed is None else [a + b for a, b in zip(summed, grads, strict=True)]
            mean += total / gas  # float32, as the engine's all-reduce adds them
        for p, g in zip(params, summed, strict=True):
            p.grad = g.mul_(1.0 / dp)
        opt.step()
        out.append(float(mean / dp))
    evaluated = torch.zeros(())
    with torch.no_grad():
        for r in range(dp):
            total = torch.zeros(())
            for x, y in batches(steps, r, config):
                for m, fn in layers:
                    x = m(x) if fn is None else fn(m, x)
                total += F.mse_loss(x, y)
            evaluated += total / gas
    named = {}
    for idx, (spec, (m, _)) in enumerate(zip(specs(tied), layers, strict=True)):
        prefix = f"tied_modules.{spec.key}" if getattr(spec, "key", None) else str(idx)
        named.update({f"{prefix}.{n}": p.detach().clone() for n, p in m.named_parameters()})
    return {"losses": out, "eval": float(evaluated / dp), "params": named}


# The layouts compared with DeepSpeed 0.19.8 (tests/data/pipeline/make_fixture.py, on 4 ranks):
# name -> train() keyword arguments
DS_CASES: dict[str, dict] = {
    "pp1_dp4": {"stages": 1},
    "pp2_dp2": {"stages": 2},
    "pp4": {"stages": 4},
    "pp2_uniform": {"stages": 2, "partition": "uniform"},
    "pp4_type": {"stages": 4, "partition": "type:block"},
    "pp2_checkpointing": {"stages": 2, "interval": 2},
    "pp2_zero1": {"stages": 2, "config": {"zero_optimization": {"stage": 1}}},
    "pp1_tied": {"stages": 1, "tied": True},
    "pp2_tied": {"stages": 2, "tied": True},
    "pp4_tied": {"stages": 4, "tied": True},
}


def ds_fixture_cases(names: list[str]) -> dict:
    """Each named DeepSpeed case trained here through the facade; rank 0's losses and partition."""
    out = {}
    for name in names:
        r = train(**DS_CASES[name], facade=True)
        out[name] = {"losses": r["losses"], "parts": r["parts"]}
    return out


def train_from_dataset(stages: int) -> tuple[list[float], list[float]]:
    """initialize(training_data=...) then train_batch() with no iterator, against the same samples handed
    in order as an iterator (DeepSpeed's loader: this replica's part, unshuffled, repeated)."""
    import shardwise
    from shardwise.pipeline import PipelineModule

    rows = [data(0, 0, i, 1) for i in range(6)]  # 6 samples: 1.5 batches of 4, so the loader repeats
    dataset = torch.utils.data.TensorDataset(torch.cat([x for x, _ in rows]), torch.cat([y for _, y in rows]))
    out = []
    for given in (True, False):
        model = PipelineModule(specs(), num_stages=stages, loss_fn=F.mse_loss, seed_layers=True,
                               seed_fn=torch.manual_seed, base_seed=BASE_SEED)
        config = {**CONFIG, "train_micro_batch_size_per_gpu": 1}
        engine, *_ = shardwise.initialize(model=model, config=config, training_data=dataset if given else None)
        if given:
            out.append([float(engine.train_batch()) for _ in range(3)])
        else:
            order = [rows[i % 6] for i in range(12)]
            it = iter(order)
            out.append([float(engine.train_batch(it)) for _ in range(3)])
    return out[0], out[1]


def resume(save_stages: int, load_stages: int, folder: str, tied: bool = False,
           save_virtual: int = 1) -> tuple[list[float], list[float]]:
    """Train 4 batches at ``save_stages`` (saving after 2), then load that checkpoint at ``load_stages`` and
    train batches 3-4 again: (the uninterrupted losses, the resumed ones). ``save_virtual``: the saving run's
    chunks per rank (interleaved 1F1B)."""
    import shardwise
    from shardwise.pipeline import PipelineModule

    def engine_at(stages: int, virtual: int = 1):
        model = PipelineModule(specs(tied), num_stages=stages, loss_fn=F.mse_loss, seed_layers=True,
                               seed_fn=torch.manual_seed, base_seed=BASE_SEED, virtual_stages=virtual)
        config = {**CONFIG, "zero_optimization": {"stage": 1}}
        if virtual > 1:
            config["pipeline"] = {"schedule": "interleaved_1f1b"}
        return shardwise.initialize(model=model, config=config)[0]

    first = engine_at(save_stages, save_virtual)
    dp = first.grid.get_data_parallel_id()
    losses = []
    for s in range(4):
        if s == 2:
            first.save_checkpoint(folder, tag="half")
        losses.append(float(first.train_batch(batches(s, dp, CONFIG))))
    second = engine_at(load_stages)
    second.load_checkpoint(folder, tag="half")
    dp = second.grid.get_data_parallel_id()
    return losses[2:], [float(second.train_batch(batches(s, dp, CONFIG))) for s in (2, 3)]
