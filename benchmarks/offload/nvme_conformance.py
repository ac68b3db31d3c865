"""ZeRO-Infinity configs as users write them, each run with NVMe offload and with the same config on the CPU.

The review of NVMe offload (docs/offload.md, "Held against real configs"): five configs written after public
ones (HF transformers' docs' NVMe example with ``aio`` moved to the top level, text-generation-webui's
``generate_ds_config``, Lightning's ``DeepSpeedStrategy`` NVMe defaults, a DeepSpeedExamples-style stage-3
config with ``pipeline_read/write``, ``sub_group_size`` and the newer ``aio`` keys, a Megatron-style ZeRO-2
one), each through the paths users take: a plain DeepSpeed script (``deepspeed.initialize``, ``backward``,
``step``, OpenRLHF's ``engine.optimizer.offload_states`` / ``reload_states`` between steps, save and a resume
in a fresh engine), the HF Trainer (``TrainingArguments(deepspeed=cfg)``, a checkpoint and a resume) and an
Accelerate loop (``save_state`` / ``load_state``). Run it under the facade, one config per launch::

    shardwise launch --nproc 2 --as-deepspeed benchmarks/offload/nvme_conformance.py OUT CONFIG SWAP_ROOT \\
        [--parts plain,trainer,accelerate]

Rank 0 writes ``OUT/<CONFIG>-<ranks>.json``: per part and device the losses, the resumed losses, a digest of
the final weights (plain) and the files left in the swap folder; NVMe and CPU must agree to the bit.
"""

import argparse
import copy
import gc
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nvme_configs import ALL, as_cpu  # noqa: E402

VOCAB, SEQ = 256, 16
RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))


def llama():
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    c = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return AutoModelForCausalLM.from_config(c)


def batch(step, micro, mbs):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + RANK)
    return torch.randint(0, VOCAB, (mbs, SEQ), generator=g)


def digest(engine):
    import deepspeed

    h = hashlib.sha256()
    ps = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(ps):
        for p in ps:
            h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def swap_files(root):
    return sorted(str(p.relative_to(root)) for p in Path(root).rglob("*") if p.is_file())


def plain(cfg, out, steps=4, save_at=2):
    import deepspeed
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

    cfg = copy.deepcopy(cfg)
    for k in ("train_batch_size",):
        cfg.pop(k, None)
    for k, v in list(cfg.items()):
        if v == "auto":
            cfg.pop(k)
    mbs = cfg.get("train_micro_batch_size_per_gpu", 1)
    gas = cfg.get("gradient_accumulation_steps", 1)
    if isinstance(cfg.get("bf16", {}).get("enabled"), str):
        cfg["bf16"]["enabled"] = True
    z = cfg["zero_optimization"]
    for k, v in list(z.items()):
        if v == "auto":
            z.pop(k)
    model = llama()
    kw = {}
    if "optimizer" not in cfg:
        kw["optimizer"] = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg, **kw)
    res = {"losses": [], "mbs": mbs, "gas": gas}

    def run(step):
        tot = 0.0
        for m in range(gas):
            ids = batch(step, m, mbs)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            tot += loss.item()
        return tot

    for step in range(1, steps + 1):
        if step == 3:  # an RL loop's sleep / wake between steps (OpenRLHF's calls)
            engine.optimizer.offload_states(
                include=[
                    OffloadStateTypeEnum.optim_states,
                    OffloadStateTypeEnum.contiguous_grad_buffer,
                    OffloadStateTypeEnum.hp_params,
                ],
                device=OffloadDeviceEnum.cpu,
                pin_memory=True,
                non_blocking=True,
            )
            engine.empty_partition_cache()
            engine.reload_states(non_blocking=True)
        res["losses"].append(run(step))
        if step == save_at:
            engine.save_checkpoint(str(out / "ckpt"), tag="s2")
    res["digest"] = digest(engine)
    try:  # OpenRLHF reads it so
        res["offload_device_cfg"] = str(engine.config["zero_optimization"]["offload_optimizer"]["device"])
    except Exception as e:
        res["offload_device_cfg"] = f"{type(e).__name__}: {e}"
    engine.destroy()
    engine = None
    gc.collect()
    # resume from step 2 into a fresh engine
    model = llama()
    kw = {"optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3)} if "optimizer" not in cfg else {}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg, **kw)
    engine.load_checkpoint(str(out / "ckpt"), tag="s2")
    res["resumed"] = [run(s) for s in range(save_at + 1, steps + 1)]
    res["resumed_digest"] = digest(engine)
    engine.destroy()
    engine = None
    gc.collect()
    return res


def trainer(cfg, out, steps=4):
    from accelerate import PartialState
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainingArguments

    AcceleratorState._reset_state(reset_partial_state=False)
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    cfg = copy.deepcopy(cfg)
    for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping"):
        cfg[k] = "auto"
    if "optimizer" in cfg:  # as HF users write it: the TrainingArguments decide
        cfg["optimizer"]["params"] = {k: "auto" for k in ("lr", "betas", "eps", "weight_decay")}
    for k in ("bf16", "fp16"):  # the Trainer on a CPU: its bf16/fp16 flags need a GPU, so "auto" (off)
        if k in cfg:
            cfg[k]["enabled"] = "auto"
    bf16 = fp16 = False
    args = TrainingArguments(
        output_dir=str(out / "trainer"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=steps,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        report_to=[],
        seed=0,
        deepspeed=cfg,
        dataloader_drop_last=True,
        disable_tqdm=True,
        bf16=bf16,
        fp16=fp16,
        use_cpu=False,
        accelerator_config={"use_configured_state": True},
    )
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": x, "labels": x.clone()} for x in torch.randint(0, VOCAB, (64, SEQ), generator=g)]
    t = Trainer(model=llama(), args=args, train_dataset=data)
    t.train()
    losses = [h["loss"] for h in t.state.log_history if "loss" in h]
    ckpts = sorted(p.name for p in (out / "trainer").iterdir())
    del t
    gc.collect()
    # resume from checkpoint-2
    AcceleratorState._reset_state(reset_partial_state=False)
    PartialState(backend="gloo")
    t = Trainer(model=llama(), args=args, train_dataset=data)
    t.train(resume_from_checkpoint=str(out / "trainer" / "checkpoint-2"))
    resumed = [h["loss"] for h in t.state.log_history if "loss" in h]
    del t
    gc.collect()
    return {"losses": losses, "resumed": resumed, "ckpts": ckpts}


def accelerate_part(cfg, out, steps=4):
    """A plain Accelerate loop (DeepSpeedPlugin(hf_ds_config=cfg)): prepare, backward, step, save_state at 2,
    then a fresh Accelerator that load_state's and runs 3-4."""
    from accelerate import Accelerator, PartialState
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin

    cfg = copy.deepcopy(cfg)
    for k in ("train_batch_size",):
        cfg.pop(k, None)
    cfg.pop("optimizer", None)  # the script's own AdamW (Accelerate refuses both)
    cfg["train_micro_batch_size_per_gpu"] = 2
    cfg["gradient_accumulation_steps"] = 1
    cfg["gradient_clipping"] = 1.0
    for k in ("bf16", "fp16"):
        if k in cfg:
            cfg[k]["enabled"] = False
    z = cfg["zero_optimization"]
    for k, v in list(z.items()):
        if v == "auto":
            z.pop(k)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": x, "labels": x.clone()} for x in torch.randint(0, VOCAB, (64, SEQ), generator=g)]

    def run(resume):
        AcceleratorState._reset_state(reset_partial_state=False)
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
        acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=copy.deepcopy(cfg)))
        model = llama()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = torch.utils.data.DataLoader(data, batch_size=2, shuffle=False)
        model, opt, loader = acc.prepare(model, opt, loader)
        if resume:
            acc.load_state(str(out / "acc_state"))
        seen = []
        for step, b in enumerate(loader, start=1):
            if resume and step <= 2:
                continue
            loss = model(**b).loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            seen.append(acc.reduce(loss.detach(), "mean").item())
            if step == 2 and not resume:
                acc.save_state(str(out / "acc_state"))
            if step == steps:
                break
        model.destroy()
        return seen

    first = run(False)
    return {"losses": first, "resumed": run(True)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("config", choices=sorted(ALL))
    ap.add_argument("swap_root", type=Path, help="a folder for the swap files (one sub-folder per run)")
    ap.add_argument("--parts", default="plain,trainer,accelerate")
    a = ap.parse_args()
    out, name, paths, parts = a.out, a.config, [a.swap_root], a.parts.split(",")
    res = {}
    for part in parts:  # every plain run first: a Trainer's TrainingArguments leave zero.Init's config live
        for mode in ("nvme", "cpu"):
            swap = Path(paths[0]) / f"{name}-{mode}-{WORLD}"
            swap.mkdir(parents=True, exist_ok=True)
            cfg = ALL[name](str(swap))
            if mode == "cpu":
                cfg = as_cpu(cfg)
            o = out / f"{name}-{mode}-{WORLD}"
            t0 = time.time()
            try:
                r = {"plain": plain, "trainer": trainer, "accelerate": accelerate_part}[part](cfg, o)
            except Exception as e:
                import traceback

                traceback.print_exc()
                r = {"error": f"{type(e).__name__}: {e}"[:600]}
            gc.collect()
            r["seconds"] = round(time.time() - t0, 1)
            r["left_in_swap"] = swap_files(swap)
            res[f"{part}-{mode}"] = r
    if RANK == 0:
        (out / f"{name}-{WORLD}.json").write_text(json.dumps(res, indent=1))
        print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
