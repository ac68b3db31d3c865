"""Regenerate this folder: a DeepSpeed 0.19.8 ``PipelineModule`` checkpoint (``layer_XX-model_states.pt``).

Needs a venv with DeepSpeed (never the project's own), on 2 and then 4 CPU ranks over gloo::

    cd tests/data/pipeline_ckpt && for n in 2 4; do DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=../../.. \
        /work/dsvenv/bin/python -m torch.distributed.run --nproc-per-node $n make_fixture.py; done

tests/pipeline_cases.py's layers (``specs()``: 6 blocks and a head, seeded by index) at 2 stages
(DeepSpeed's partition [0, 4, 7]), ZeRO-1, AdamW, 2 batches of ``train_batch``, then
``engine.save_checkpoint("z1")``: ``z1/global_step2/`` holds one ``layer_XX-model_states.pt`` per
layer (XX its global index), ``mp_rank_00/01_model_states.pt`` (one per stage) and
``zero_pp_rank_0_mp_rank_00/01_optim_states.pt`` (each stage's optimizer). ``z1/reference.safetensors``:
every layer's weights as DeepSpeed held them after the save (``layer.IDX.name``, fp32), and
``z1/losses.json`` the losses of batches 3-4 the same run gives after the save (what a resume
continues with). On 4 ranks the same at PP 2 x DP 2 into ``z1_dp2`` (each stage's optimizer
partitioned over its 2 data-parallel ranks: ``zero_pp_rank_0/1_mp_rank_00/01_optim_states.pt``).

On 2 ranks also ``z1_tied``: the tied layers (``specs(True)``: a ``TiedLayerSpec("proj")`` first, whose
weight the last layer reuses through ``forward_fn``) at 2 stages (partition [0, 4, 8]). DeepSpeed names
the tied weight ``tied_modules.proj.weight`` in both stages' ``param_shapes`` and optimizers (each stage
steps its copy on the all-reduced gradient) and writes it once, in ``layer_00-model_states.pt`` as
``weight`` (the use that is a module; the head's use is a ``functools.partial``, which has no file).
``reference.safetensors`` is keyed ``layer.NAME`` by the module's parameter names; ``losses.json`` says
whether the two stages' copies were equal bit for bit (``tied_copies_equal``).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # tests/
import pipeline_cases as pc  # noqa: E402


def make(name: str, tied: bool) -> None:
    """Train 2 batches, save into ``name``, record the weights and the next 2 batches' losses."""
    import deepspeed
    from deepspeed import pipe
    from safetensors.torch import save_file

    torch.manual_seed(0)
    cfg = {**pc.CONFIG, "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True}
    model = pipe.PipelineModule(pc.specs(tied, pipe), num_stages=2, loss_fn=F.mse_loss, seed_layers=True,
                                seed_fn=torch.manual_seed, base_seed=pc.BASE_SEED)
    engine, *_ = deepspeed.initialize(model=model, config=cfg,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    dp = engine.grid.get_data_parallel_id()
    out = HERE / name
    before = [float(engine.train_batch(pc.batches(s, dp, cfg))) for s in range(2)]
    engine.save_checkpoint(str(out))
    # the module's own names: IDX.fc.weight, and tied_modules.KEY.weight on every stage holding a use
    weights = {f"layer.{n}": v.detach().float().clone().contiguous() for n, v in model.named_parameters()}
    after = [float(engine.train_batch(pc.batches(s, dp, cfg))) for s in (2, 3)]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, weights)
    if dist.get_rank() == 0:  # each stage's first data-parallel rank holds the stage's layers (the same on the rest)
        ref, equal = {}, True
        for w in gathered:
            for k, v in w.items():
                equal = equal and (k not in ref or torch.equal(ref[k], v))
                ref.setdefault(k, v)
        save_file(ref, str(out / "reference.safetensors"))
        info = {"deepspeed": deepspeed.__version__, "before": before, "after": after,
                "parts": [int(p) for p in model.parts]}
        if tied:
            info["tied_copies_equal"] = equal
        (out / "losses.json").write_text(json.dumps(info, indent=1) + "\n")
        for f in out.glob("zero_to_*.py"):
            f.unlink()
        shutil.rmtree(out / "global_step2" / "__pycache__", ignore_errors=True)
    dist.barrier()


def main() -> None:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    if world == 2:
        make("z1", False)
        make("z1_tied", True)
    else:
        make(f"z1_dp{world // 2}", False)


if __name__ == "__main__":
    main()
