"""Rank-side runs for NVMe offload (tests/test_nvme.py): the same training with CPU offload and with
NVMe offload, checkpoints through swap files, and the faults a swap file can meet."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from tiny_models import batches, build
from zero_cases import run_micro_batches

import shardwise
from shardwise.checkpoint import save_checkpoint as save_plain
from shardwise.zero import GatheredParameters

PRECISIONS = {  # name -> config sections: bf16/fp16 compute, and bf16 masters with bf16 optimizer states
    "bf16": {"bf16": {"enabled": True}},
    "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8}},
    "bf16_states": {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
                             "bf16_optimizer_states": True}},
}


def config(stage: int, precision: str, device: str, nvme_path: str | None = None, **nvme) -> dict:
    world = dist.get_world_size()
    oo = {"device": device, **({"nvme_path": nvme_path} if nvme_path else {}), **nvme}
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 2 * world,
            "steps_per_print": 0, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 20_000, "allgather_bucket_size": 20_000,
                                  "offload_optimizer": oo},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            **PRECISIONS[precision]}


def _weights(model) -> dict[str, torch.Tensor]:
    with GatheredParameters(list(model.parameters())):
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _train(cfg: dict, steps: int = 3, engine=None, data=None, start: int = 0):
    if engine is None:
        engine, *_ = shardwise.initialize(model=build("llama"), config=cfg)
    data = batches(start + steps, 1, 2 * dist.get_world_size(), 16) if data is None else data
    losses = run_micro_batches(engine, data[start:start + steps], dist.get_rank(), 2)
    return engine, losses


def cpu_vs_nvme(stage: int, precisions: list[str], param_cpu: bool = False) -> dict:
    """Per precision: losses and weights with CPU offload and with NVMe offload (pipelined, 2 buffers);
    ``param_cpu``: with ``offload_param`` on the CPU in both."""
    out = {}
    for precision in precisions:
        cfgs = [config(stage, precision, "cpu"), config(stage, precision, "nvme", root := tempfile.mkdtemp(),
                                                        buffer_count=2, pipeline_read=True, pipeline_write=True)]
        for cfg in cfgs:
            if param_cpu:
                cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
        cpu, cpu_losses = _train(cfgs[0])
        nvme, nvme_losses = _train(cfgs[1])
        files = sorted(p.name for p in (Path(root) / "shardwise-swap" / f"rank{dist.get_rank()}").iterdir())
        swap_bytes = sum(layout.nbytes for layout in nvme.nvme.layouts)
        report = dict(nvme.memory_report())
        out[precision] = {"losses": (cpu_losses, nvme_losses), "report": report, "files": files,
                          "swap_bytes": swap_bytes, "buffers": [b.nbytes for b in nvme.nvme.buffers],
                          "cpu_report": dict(cpu.memory_report()),
                          "same_weights": all(torch.equal(a, b) for a, b in
                                              zip(_weights(cpu.module).values(), _weights(nvme.module).values(),
                                                  strict=True))}
        nvme.destroy()
        cpu.destroy()
        out[precision]["left_after_destroy"] = sorted(os.listdir(root))
    return out


def checkpoint_resume(stage: int, precision: str, save_dir: str, sub_group_size: int = 1_000_000_000) -> dict:
    """Save at step 2 with NVMe-held state, run to step 4; load into a fresh engine on another nvme_path
    and into a CPU-offload engine at another stage (another layout), run steps 3-4 in each. The NVMe
    engines cut their groups into ``sub_group_size`` pieces."""
    data = batches(4, 1, 2 * dist.get_world_size(), 16)
    paths = [tempfile.mkdtemp() for _ in range(2)]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(paths := [paths], src=0)
        paths = paths[0]
    nvme_cfg = [config(stage, precision, "nvme", p, pipeline_read=True) for p in paths]
    for cfg in nvme_cfg:
        cfg["zero_optimization"]["sub_group_size"] = sub_group_size
    first, _ = _train(nvme_cfg[0], 2, data=data)
    reads = _spy_group_reads(first.nvme)
    first.save_checkpoint(save_dir, tag="s2")  # streamed: each group read as the writer reaches it
    streamed = {"reads": len(reads), "groups_once": len(set(r[0] for r in reads)) == len(reads),
                "previous_dropped": all(r[1] for r in reads), "left": first.nvme.current is not None}
    with first.nvme.resident(write_back=False):  # the save before streaming: every group read whole first
        save_plain(first, save_dir, tag="s2_resident")
    rank_file = f"rank{dist.get_rank():05d}.safetensors"
    streamed["same_bytes"] = (Path(save_dir) / "s2" / rank_file).read_bytes() == \
        (Path(save_dir) / "s2_resident" / rank_file).read_bytes()
    _, straight = _train({}, 2, engine=first, data=data, start=2)
    first.destroy()
    cpu_first, _ = _train(config(stage, precision, "cpu"), 2, data=data)
    cpu_first.save_checkpoint(save_dir, tag="cpu2")
    cpu_first.destroy()
    same_consolidated = None
    if dist.get_rank() == 0:  # consolidate reads both: the NVMe-held state saved is CPU offload's, bit for bit
        from shardwise.checkpoint.hf import iter_consolidated

        tensors = [dict(iter_consolidated(save_dir, tag)[2]) for tag in ("s2", "cpu2")]
        same_consolidated = tensors[0].keys() == tensors[1].keys() and all(
            torch.equal(tensors[0][k], tensors[1][k]) for k in tensors[0])
    again = shardwise.initialize(model=build("llama"), config=nvme_cfg[1])[0]
    again.load_checkpoint(save_dir, tag="s2")
    _, resumed = _train({}, 2, engine=again, data=data, start=2)
    other_stage = 3 if stage != 3 else 1
    cpu = shardwise.initialize(model=build("llama"), config=config(other_stage, precision, "cpu"))[0]
    cpu.load_checkpoint(save_dir, tag="s2")
    _, resharded = _train({}, 2, engine=cpu, data=data, start=2)
    again.destroy()
    cpu.destroy()
    return {"straight": straight, "resumed": resumed, "resharded": resharded, "consolidated": same_consolidated,
            "streamed": streamed}


def _spy_group_reads(swapper) -> list[tuple[int, bool]]:
    """Each group read of a streamed save: (the group's id, whether the group read before was dropped first)."""
    reads: list[tuple[int, bool]] = []
    read = swapper._read_for_save

    def spy(g):
        reads.append((id(g), swapper.current is None))
        return read(g)
    swapper._read_for_save = spy
    return reads


def faults(root: str) -> dict:
    """One rank: a swap file truncated, one changed, and a second engine of this process on the same
    nvme_path (its own folder; another process is refused: tests/test_nvme_folder.py)."""
    out: dict[str, str] = {}
    cfg = config(2, "bf16", "nvme", root)
    engine, _ = _train(cfg, 1)
    second, _ = _train(cfg, 1)
    out["second_engine"] = f"{engine.nvme.folder.path.name} {second.nvme.folder.path.name}"
    second.destroy()
    layouts = engine.nvme.layouts
    with open(layouts[0].path, "r+b") as f:
        f.truncate(layouts[0].used() - 4096)
    out["truncated"] = _step_error(engine)
    engine.destroy()
    engine, _ = _train(cfg, 1)
    path = engine.nvme.layouts[-1].path
    with open(path, "r+b") as f:
        f.seek(4096 + 8)
        byte = f.read(1)
        f.seek(4096 + 8)
        f.write(bytes([byte[0] ^ 1]))
    try:  # the streamed save reads the changed file: refused, nothing published, the save's read dropped
        engine.save_checkpoint(tempfile.mkdtemp(), tag="bad")
        out["save_changed"] = "no error"
    except Exception as e:  # noqa: BLE001 - the message is the result
        out["save_changed"] = f"{type(e).__name__}: {e}"
    out["save_left"] = str((engine.nvme.streaming, engine.nvme.current))
    out["changed"] = _step_error(engine)
    engine.destroy()
    out["left"] = str(sorted(os.listdir(root)))
    return out


def _step_error(engine) -> str:
    try:
        _train({}, 1, engine=engine)
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return "no error"


def offload_reload(stage: int, precision: str = "bf16", tp: int = 1) -> dict:
    """Two steps, ``offload_states`` (host storages moved too: the CPU run's stand-in for a device), a
    refused forward, ``reload_states``, two steps: against four steps never offloaded."""
    from shardwise.engine.offload_states import offload_states

    world = dist.get_world_size()
    cfg = config(stage, precision, "none")
    cfg["zero_optimization"].pop("offload_optimizer")
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
        cfg["train_batch_size"] = 2 * world // tp
    dp_rank, dp = dist.get_rank() // tp, world // tp
    data = batches(4, 1, 2 * dp, 16)

    def run(engine, start: int) -> list[float]:
        return run_micro_batches(engine, data[start:start + 2], dp_rank, 2)

    plain = shardwise.initialize(model=build("llama"), config=cfg)[0]
    straight = run(plain, 0) + run(plain, 2)
    engine = shardwise.initialize(model=build("llama"), config=cfg)[0]
    first = run(engine, 0)
    before = dict(engine.memory_report())
    offload_states(engine, move_host=True)
    during = dict(engine.memory_report())
    try:
        run(engine, 2)
        refused = "no error"
    except Exception as e:  # noqa: BLE001 - the message is the result
        refused = f"{type(e).__name__}: {e}"
    engine.reload_states()
    after = dict(engine.memory_report())
    resumed = first + run(engine, 2)
    plain.destroy()
    engine.destroy()
    return {"straight": straight, "resumed": resumed, "before": before, "during": during, "after": after,
            "refused": refused}


def refusals(root: str) -> dict:
    """One rank: what initialize says to bad NVMe settings, before any training."""
    out = {}
    bad = {
        "missing": config(2, "bf16", "nvme", os.path.join(root, "nope")),
        "no_path": config(2, "bf16", "nvme"),
        "gds": {**config(2, "bf16", "nvme", root), "aio": {"use_gds": True}},
        "aio_typo": {**config(2, "bf16", "nvme", root), "aio": {"queue_dept": 8}},
    }
    for name, cfg in bad.items():
        try:
            shardwise.initialize(model=build("llama"), config=cfg)
            out[name] = "no error"
        except Exception as e:  # noqa: BLE001 - the message is the result
            out[name] = f"{type(e).__name__}: {e}"
    model = build("llama")
    opt = torch.optim.Adafactor(model.parameters(), lr=1e-3)
    try:
        shardwise.initialize(model=model, optimizer=opt, config=config(2, "bf16", "nvme", root))
        out["adafactor"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["adafactor"] = f"{type(e).__name__}: {e}"
    out["left"] = sorted(os.listdir(root))
    return out


def params_on_nvme(save_dir: str) -> dict:
    """Stage 3 with every parameter shard in a swap file (persistence threshold 0): the losses of CPU
    parameter offload, beside CPU and NVMe optimizer offload; a checkpoint resumed into another nvme_path."""
    def cfg(param: str, opt: str, root: str | None = None, max_in_cpu: int = 0) -> dict:
        c = config(3, "bf16", opt, root, pipeline_read=True) if opt == "nvme" else config(3, "bf16", opt)
        c["zero_optimization"].update(stage3_param_persistence_threshold=0, offload_param={"device": param})
        if param == "nvme":
            c["zero_optimization"]["offload_param"].update(nvme_path=root, buffer_count=2, buffer_size=3000,
                                                           max_in_cpu=max_in_cpu)
        return c

    data = batches(4, 1, 2 * dist.get_world_size(), 16)
    roots = [tempfile.mkdtemp() for _ in range(3)]
    out: dict = {}
    for name, param, opt in (("cpu", "cpu", "cpu"), ("nvme_cpu", "nvme", "cpu"), ("nvme_nvme", "nvme", "nvme")):
        # max_in_cpu: the first 40,000 elements of shards stay in host memory beside CPU optimizer offload
        engine, losses = _train(cfg(param, opt, roots[0], 40_000 if opt == "cpu" else 0), 4, data=data)
        out[name] = losses
        if name == "nvme_nvme":
            out["report"] = dict(engine.memory_report())
            units = [g for gs in engine.unit_groups for g in gs]
            out["store_bytes"] = sum(g.store.nbytes for g in units)  # no shard in memory (max_in_cpu 0)
            out["param_files"] = sum(s.file is not None for s in engine.nvme_params.stores)
            out["param_file_bytes"] = sum(s.numel * 2 for s in engine.nvme_params.stores if s.file is not None)
            out["reads"] = dict(engine.nvme_params.waits)  # reads made ahead (prefetch) and all reads
        engine.destroy()
    out["left"] = os.listdir(roots[0])
    first, _ = _train(cfg("nvme", "cpu", roots[1]), 2, data=data)
    first.save_checkpoint(save_dir, tag="p2")
    first.destroy()
    again = shardwise.initialize(model=build("llama"), config=cfg("nvme", "cpu", roots[2]))[0]
    again.load_checkpoint(save_dir, tag="p2")
    _, out["resumed"] = _train({}, 2, engine=again, data=data, start=2)
    again.destroy()
    return out


def sp_offload_reload(stage: int) -> dict:
    """Ulysses SP over 2 ranks: offload_states() and reload_states() before the second step, against
    the same training never offloaded."""
    import sp_cases

    from shardwise.engine.offload_states import offload_states

    def run(offload_at: int) -> list[float]:
        cfg = sp_cases.sp_config(stage, 2, dist.get_world_size())
        engine = shardwise.initialize(model=sp_cases.llama(), config=cfg)[0]
        sp, losses = engine.sequence_parallel, []
        for i, replicas in enumerate(sp_cases.step_batches(engine.dp_world)):
            if i == offload_at:
                offload_states(engine, move_host=True)
                engine.reload_states()
            shard = sp_cases.split_batch(replicas[engine.dp_rank], sp)
            labels = shard.pop("shift_labels")
            loss = sp_cases.sequence_parallel_loss(engine(**shard).logits, labels, sp)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        engine.destroy()
        return losses

    return {"straight": run(-1), "offloaded": run(1)}


def ep_offload_reload(stage: int) -> dict:
    """Expert parallelism over 2 ranks (a Mixtral): offload_states() and reload_states() before the second
    step, against the same training never offloaded."""
    import moe_cases

    from shardwise.engine.offload_states import offload_states

    def run(offload_at: int) -> list[float]:
        model = moe_cases.build("mixtral")
        moe_cases.apply_expert_parallel(model, 2, preset="mixtral")
        engine = shardwise.initialize(model=model, config=moe_cases.ds_config(stage, 0.5, 2, 2, None))[0]
        data, losses = moe_cases.batches(3, 2, 2), []
        for s in range(3):
            if s == offload_at:
                offload_states(engine, move_host=True)
                engine.reload_states()
            ids = data[s, engine.dp_rank]
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        engine.destroy()
        return losses

    return {"straight": run(-1), "offloaded": run(1)}


def edit_then_train(stage: int, sub_group_size: int = 1_000_000_000) -> dict:
    """An edit of the parameters between steps (GatheredParameters with a modifier rank): with NVMe offload
    the master in the swap file(s) takes it, as the CPU-offload master does."""
    from shardwise.zero import GatheredParameters

    out = {}
    for device in ("cpu", "nvme"):
        cfg = config(stage, "bf16", device, tempfile.mkdtemp() if device == "nvme" else None)
        cfg["zero_optimization"]["sub_group_size"] = sub_group_size
        engine, first = _train(cfg, 1)
        with GatheredParameters(list(engine.module.parameters()), modifier_rank=0):
            if dist.get_rank() == 0:
                with torch.no_grad():
                    engine.module.model.embed_tokens.weight.mul_(0.5)
        _, after = _train({}, 2, engine=engine, start=1)
        out[device] = first + after
        engine.destroy()
    out["unedited"] = _train(config(stage, "bf16", "cpu"), 3)[1]
    return out


def client_deepspeed_adam() -> dict:
    """A DeepSpeed script's client DeepSpeedCPUAdam (the facade's), CPU offload against NVMe offload."""
    from shardwise.deepspeed.ops import DeepSpeedCPUAdam

    out = {}
    for device in ("cpu", "nvme"):
        model = build("llama")
        opt = DeepSpeedCPUAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
        cfg = config(2, "bf16", device, tempfile.mkdtemp() if device == "nvme" else None)
        del cfg["optimizer"]
        engine = shardwise.initialize(model=model, optimizer=opt, config=cfg)[0]
        out[device] = _train({}, 3, engine=engine)[1]
        out[f"{device}_swapped"] = engine.nvme is not None
        engine.destroy()
    return out


def sub_groups(stage: int, precision: str, sub_group_size: int) -> dict:
    """CPU offload against NVMe offload with ``sub_group_size`` pieces, two micro-batches a step and clipping:
    losses, weights, the pieces, and the host bytes (the buffers, by their formula) with no gradient kept."""
    world = dist.get_world_size()
    cfgs = [config(stage, precision, "cpu"), config(stage, precision, "nvme", tempfile.mkdtemp(), buffer_count=2,
                                                    pipeline_read=True, pipeline_write=True)]
    for cfg in cfgs:
        cfg.update(gradient_accumulation_steps=2, train_batch_size=4 * world)
        cfg["zero_optimization"]["sub_group_size"] = sub_group_size
    data = batches(3, 2, 2 * world, 16)
    cpu, cpu_losses = _train(cfgs[0], 3, data=data)
    nvme, nvme_losses = _train(cfgs[1], 3, data=data)
    sw = nvme.nvme
    per_buffer = sw.grad_at + -(-max(p.numel * p.group.master.element_size() for p in sw.pieces) // 4096) * 4096
    out = {"losses": (cpu_losses, nvme_losses), "norms": (cpu.last_grad_norm, nvme.last_grad_norm),
           "same_weights": all(torch.equal(a, b) for a, b in zip(_weights(cpu.module).values(),
                                                                 _weights(nvme.module).values(), strict=True)),
           "groups": [g.own_numel for _, g in sw.units], "pieces": [(p.index, p.numel) for p in sw.pieces],
           "file_bytes": [layout.nbytes for layout in sw.layouts], "per_buffer": per_buffer,
           "element": sw.units[0][1].master.element_size(),
           "staging": sw.staging.nbytes if sw.staging is not None else 0,
           "nvme_buffers": dict(nvme.memory_report())["nvme_buffers"],
           "host_grads": [g.master.grad is not None or g.to_host is not None for _, g in sw.units]}
    nvme.destroy()
    cpu.destroy()
    return out


def openrlhf_sleep_wake() -> dict:
    """OpenRLHF's ``offload_deepspeed_states`` / ``reload_deepspeed_states`` on a facade engine (stage 3,
    NVMe optimizer offload): it reads ``engine.config[...]["offload_optimizer"]["device"]`` and calls
    ``engine.optimizer.offload_states(...)``, ``empty_partition_cache()``, then ``engine.reload_states()``;
    the losses against CPU offload never put to sleep."""
    from shardwise.deepspeed.names import OffloadDeviceEnum, OffloadStateTypeEnum
    from shardwise.deepspeed.stage3 import initialize as facade_initialize

    data = batches(3, 1, 2 * dist.get_world_size(), 16)
    out: dict = {}
    for device in ("cpu", "nvme"):
        engine = facade_initialize(model=build("llama"), config=config(3, "bf16", device, tempfile.mkdtemp()))[0]
        losses = run_micro_batches(engine, data[:1], dist.get_rank(), 2)
        out[f"{device}_config"] = engine.config["zero_optimization"]["offload_optimizer"]["device"]
        kinds = [OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.contiguous_grad_buffer,
                 OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.lp_grads]
        engine.optimizer.offload_states(include=kinds, device=OffloadDeviceEnum.cpu, pin_memory=True,
                                        non_blocking=True)
        engine.empty_partition_cache()
        out[f"{device}_refused"] = _step_error(engine)  # asleep: the call reached the engine
        engine.optimizer.reload_states(non_blocking=True)
        out[device] = losses + run_micro_batches(engine, data[1:], dist.get_rank(), 2)
        engine.destroy()
    return out
