"""Every key of DeepSpeed 0.19's config, classified: the one table that says what shardwise does with it.

honoured: implemented (the schema in config/schema.py validates it, the engine uses it).
ignored:  no effect on the numbers (logging, profilers, performance knobs): accepted, one notice.
refused:  changes training and is not implemented: "DeepSpeed feature X (path) is not implemented by
          shardwise" unless the value asks for nothing (the default, or `enabled: false`).
A key may be honoured only for some values (`accepts`); other values are refused like a refused key.
Sections marked `subtree` cover all their sub-keys. `python -m shardwise.config.keys --markdown` prints
the table of docs/config.md (a test keeps them equal).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Status = Literal["honoured", "ignored", "refused"]
Accepts = Callable[[Any, dict[str, Any]], bool]  # (value, whole normalized config) -> allowed?


@dataclass(frozen=True)
class Key:
    path: str
    status: Status
    note: str  # honoured: what shardwise does; ignored: why it is harmless; refused: the feature's name
    accepts: Accepts | None = None  # values allowed (refused keys: the "asks for nothing" values)
    subtree: bool = False  # the entry covers every sub-key (not checked individually)


def default(*values: Any) -> Accepts:
    """Allowed: absent-equivalent values (None always counts as absent)."""
    return lambda v, _root: v is None or any(v == d and type(v) is type(d) for d in values)


def flag_off(v: Any) -> bool:
    """An `enabled`-style flag that asks for nothing: absent/null, false or 0. Anything else (true, 1,
    and also an ambiguous "false" string) counts as on, so a refused feature is never dropped silently."""
    return v is None or v is False or (type(v) is int and v == 0)


def flag_on(v: Any) -> bool:
    """The schema's reading of a boolean flag (config/schema.py, _strict_bool): true or 1."""
    return v is True or (type(v) is int and v == 1)


def disabled(v: Any, _root: dict[str, Any]) -> bool:
    """A section that enables nothing: null, {}, or no `"enabled"` flag that is on anywhere inside it."""
    if isinstance(v, dict):
        return all(disabled(x, _root) for k, x in v.items() if k != "enabled") and flag_off(v.get("enabled"))
    if isinstance(v, list):
        return all(disabled(x, _root) for x in v)
    return True


def precision_of(root: dict[str, Any]) -> str:
    def on(section: str) -> bool:
        s = root.get(section)
        return isinstance(s, dict) and flag_on(s.get("enabled"))
    return "bf16" if on("bf16") else "fp16" if on("fp16") else "fp32"


_DTYPE_NAMES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "fp16": "fp16", "float16": "fp16",
                "half": "fp16", "bf16": "bf16", "bfloat16": "bf16"}


def dtype_name(v: Any) -> str | None:
    """"fp32", "fp16" or "bf16" for any of DeepSpeed's spellings of a dtype; None otherwise."""
    return _DTYPE_NAMES.get(v.lower()) if isinstance(v, str) else None


def same_as_precision(v: Any, root: dict[str, Any]) -> bool:
    return v is None or dtype_name(v) == precision_of(root)


def grad_accum_ok(v: Any, root: dict[str, Any]) -> bool:
    """The compute dtype, or fp32 (wider than any compute dtype: zero/grad_accum.py), at every stage.
    Another value (bf16 or fp16 not the compute dtype) is refused at stages 0-1; DeepSpeed's ZeRO-2/3
    optimizers do not read the key, so there it is accepted and, as by DeepSpeed, ignored."""
    zero = root.get("zero_optimization")
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    return same_as_precision(v, root) or dtype_name(v) == "fp32" or (isinstance(stage, int) and stage >= 2)


def low_master_ok(precision: str) -> Accepts:
    """``<precision>_master_weights_and_grads``: off, or on with that compute precision and the compute
    dtype for gradient accumulation (the master's gradient is the reduced gradient itself)."""
    def ok(v: Any, root: dict[str, Any]) -> bool:
        if flag_off(v):
            return True
        types = root.get("data_types")
        accum = types.get("grad_accum_dtype") if isinstance(types, dict) else None
        return flag_on(v) and precision_of(root) == precision and (accum is None or dtype_name(accum) == precision)
    return ok


def bf16_states_ok(v: Any, root: dict[str, Any]) -> bool:
    """bf16 optimizer states only beside a bf16 master (as DeepSpeed asserts)."""
    bf16 = root.get("bf16")
    return flag_off(v) or (flag_on(v) and isinstance(bf16, dict) and flag_on(bf16.get("bf16_master_weights_and_grads")))


def master_update_ok(v: Any, root: dict[str, Any]) -> bool:
    """Stochastic rounding is bf16's (a truncation of fp32's low 16 bits); fp16 has no such cut."""
    return v != "stochastic" or precision_of(root) == "bf16"


def _off(key: str) -> Accepts:
    """A section whose `key` flag (a bool) is not true."""
    return lambda v, _r: not isinstance(v, dict) or flag_off(v.get(key))


H, I, R = "honoured", "ignored", "refused"
EP = "expert_parallel."
Z, OO, OP, TP = "zero_optimization.", "zero_optimization.offload_optimizer.", "zero_optimization.offload_param.", \
    "tensor_parallel."
_LOG = "logging or monitoring only"
_PERF = "a performance or memory knob; the numbers do not depend on it"

KEYS: tuple[Key, ...] = (
    # -- batch, optimizer, scheduler, clipping ---------------------------------------------------------
    Key("train_batch_size", H, "batch rule (see Batch sizes)"),
    Key("train_micro_batch_size_per_gpu", H, "batch rule; the DataLoader batch size"),
    Key("gradient_accumulation_steps", H, "batch rule; steps between optimizer updates"),
    Key("gradient_clipping", H, "global-norm clipping before the optimizer step"),
    Key("optimizer", H, "section"),
    Key("optimizer.type", H, "Adam, AdamW, SGD (flat shards), Lamb, Muon (whole tensors, "
        "[optimizers.md](optimizers.md)); others refused: pass a client optimizer"),
    Key("optimizer.params", H, "checked per type (see optimizer)"),
    Key("optimizer.legacy_fusion", I, "a DeepSpeed fused-kernel switch"),
    Key("scheduler", H, "section"),
    Key("scheduler.type", H, "WarmupLR, WarmupDecayLR, WarmupCosineLR (others refused)"),
    Key("scheduler.params", H, "checked per type (see scheduler)"),
    Key("seed", H, "shardwise: the DistributedSampler shuffle seed"),
    Key("dataloader_drop_last", H, "drop_last of the DataLoader initialize() builds"),
    Key("steps_per_print", H, "a progress line (loss, lr, samples/s, tokens/s, memory) every N steps on rank 0"),
    # -- gradient reduction ---------------------------------------------------------------------------
    Key("prescale_gradients", H, "gradients are averaged over data-parallel ranks either way; DeepSpeed "
        "only moves the 1/world division before the sum (same value up to float rounding, exact for "
        "power-of-two worlds)"),
    Key("gradient_predivide_factor", H, "as prescale_gradients: g/f summed then times f/world is the same "
        "mean up to float rounding"),
    Key("gradient_allreduce_op", H, "'mean' averages gradients over data-parallel ranks, 'sum' adds them (at "
        "every stage; DeepSpeed refuses 'sum' at stage 3)"),
    Key("communication_data_type", H, "gradients are reduced in the compute dtype; only that dtype (or "
        "null) is accepted", same_as_precision),
    Key("seq_parallel_communication_data_type", I, "used only with sequence parallelism (refused)"),
    Key("sparse_gradients", R, "sparse embedding gradients", default(False)),
    Key("disable_allgather", I, "unused by DeepSpeed's engine"),
    Key("managed_gradient_accumulation", I, "DeepSpeed bookkeeping of the accumulation boundary"),
    # -- precision ------------------------------------------------------------------------------------
    Key("fp16", H, "section"),
    Key("fp16.enabled", H, "fp16 compute with fp32 master weights"),
    Key("fp16.loss_scale", H, "0 = dynamic loss scaling, else static"),
    Key("fp16.initial_scale_power", H, "dynamic loss scaler"),
    Key("fp16.loss_scale_window", H, "dynamic loss scaler"),
    Key("fp16.hysteresis", H, "dynamic loss scaler"),
    Key("fp16.consecutive_hysteresis", H, "dynamic loss scaler"),
    Key("fp16.min_loss_scale", H, "dynamic loss scaler"),
    Key("fp16.auto_cast", R, "fp16 auto_cast of the inputs", default(False)),
    Key("fp16.fp16_master_weights_and_grads", H, "fp16 master weights and gradients, fp32 optimizer states, at "
        "every stage, with or without offload (docs/precision.md); needs fp16.enabled and the compute dtype for "
        "gradient accumulation", low_master_ok("fp16")),
    Key("bf16", H, "section (`bfloat16` is the deprecated name)"),
    Key("bf16.enabled", H, "bf16 compute with fp32 master weights"),
    Key("bf16.immediate_grad_update", I, "when DeepSpeed's stage-0/1 bf16 optimizer moves gradients; "
        "the accumulation dtype is data_types.grad_accum_dtype"),
    Key("bf16.check_grad_overflow", I, "a non-finite gradient norm stops training with NonFiniteError, a "
        "FloatingPointError (never a silent step), unless `shardwise.max_nonfinite_steps` lets it be skipped"),
    Key("bf16.bf16_master_weights_and_grads", H, "bf16 master weights and gradients (optimizer states fp32 "
        "unless bf16_optimizer_states), at every stage, with or without offload (docs/precision.md); needs "
        "bf16.enabled and the compute dtype for gradient accumulation", low_master_ok("bf16")),
    Key("bf16.bf16_optimizer_states", H, "bf16 optimizer states; needs bf16_master_weights_and_grads",
        bf16_states_ok),
    Key("data_types", H, "section"),
    Key("data_types.grad_accum_dtype", H, "the compute dtype (default), or fp32 with bf16/fp16 compute: "
        "gradients accumulate over micro-batches and are reduced in fp32, at every stage (param.grad is "
        "then None after backward: read safe_get_full_grad); another dtype is refused at stages 0-1 "
        "(DeepSpeed ignores it at stages 2-3)", grad_accum_ok),
    Key("data_types.param_dtype", H, "parameters are in the compute dtype; only that dtype (or null)",
        same_as_precision),
    Key("data_types.buffer_dtype", R, "casting buffers (buffers keep their dtype)", default()),
    Key("amp", R, "NVIDIA Apex AMP", disabled, subtree=True),
    Key("torch_autocast", R, "torch.autocast mixed precision", disabled, subtree=True),
    # -- ZeRO -----------------------------------------------------------------------------------------
    Key("zero_optimization", H, "section"),
    Key(Z + "stage", H, "ZeRO stage 0-3"),
    Key(Z + "overlap_comm", H, "asynchronous reduction (default: true at stage 3)"),
    Key(Z + "reduce_bucket_size", H, "bucket size (elements)"),
    Key(Z + "allgather_bucket_size", H, "bucket size (elements)"),
    Key(Z + "stage3_prefetch_bucket_size", H, "stage-3 prefetch depth (also `prefetch_bucket_size`)"),
    Key(Z + "stage3_param_persistence_threshold", H, "stage-3: smaller parameters stay gathered"),
    Key(Z + "stage3_max_live_parameters", H, "stage-3: gathered-parameter cap for prefetch"),
    Key(Z + "cpu_offload", H, "deprecated: offload_optimizer.device cpu"),
    Key(Z + "cpu_offload_param", H, "deprecated: offload_param.device cpu"),
    Key(Z + "cpu_offload_use_pin_memory", H, "deprecated: pin_memory of the offload sections"),
    Key(Z + "stage3_gather_fp16_weights_on_model_save", H, "deprecated name of the 16bit key"),
    Key(Z + "offload_optimizer", H, "section"),
    Key(OO + "device", H, "none, cpu, or nvme (ZeRO-Infinity, stages 1-3: master and optimizer state in swap "
        "files under nvme_path; [offload.md](offload.md))"),
    Key(OO + "pin_memory", H, "pinned host buffers"),
    Key(OP + "device", H, "none, cpu, or nvme (stage 3: the parameter shards in swap files under nvme_path; "
        "[offload.md](offload.md))"),
    Key(OP + "pin_memory", H, "pinned host buffers"),
    Key(Z + "offload_param", H, "section"),
    Key(Z + "zero_quantized_weights", H, "ZeRO++ qwZ: stage-3 parameter all-gather in block-wise int8 "
        "(stage 3 only; the shard and the fp32 master stay exact)"),
    Key(Z + "zero_quantized_nontrainable_weights", R, "ZeRO++ quantized frozen weights", default(False)),
    Key(Z + "zero_quantized_gradients", H, "ZeRO++ qgZ: gradient reduce-scatter in block-wise int8 (or int4: "
        "`shardwise.quantized_gradient_bits`) as one all-to-all, summed in fp32 (stages 1-3)"),
    Key(Z + "zero_hpz_partition_size", H, "ZeRO++ hpZ at stage 3: a secondary copy of the parameters sharded "
        "over k ranks (a node) serves the backward gathers"),
    Key(Z + "zeropp_loco_param", R, "ZeRO++ LoCo error feedback", default()),
    Key(Z + "mics_shard_size", H, "hybrid sharding: ZeRO shards within groups of k ranks, replicas across "
        "them all-reduce the gradient shard (stages 1-3)"),
    Key(Z + "zenflow", R, "ZenFlow stale gradient updates", default()),
    Key(Z + "load_from_fp32_weights", R, "restoring fp32 master weights from 16-bit weights (false)",
        default(True)),
    *(Key(Z + k, I, _PERF) for k in (
        "contiguous_gradients", "reduce_scatter", "use_multi_rank_bucket_allreduce", "allgather_partitions",
        "round_robin_gradients", "stage3_max_reuse_distance", "model_persistence_threshold",
        "stage3_module_granularity_threshold", "stage3_use_all_reduce_for_fetch_params",
        "stage3_allgather_sequential", "use_all_reduce_for_fetch_params", "allgather_sequential",
        "legacy_stage1", "memory_efficient_linear", "mics_hierarchical_params_gather",
        "pipeline_loading_checkpoint", "override_module_apply", "save_muon_momentum_buffer_in_memory")),
    Key(Z + "sub_group_size", H, "offload_optimizer.device nvme: elements of one sub-group, a group's master shard "
        "larger is stepped in pieces (one swap file and one host buffer's worth each, bit for bit one step; "
        "[offload.md](offload.md)); without NVMe offload nothing depends on it"),
    Key(Z + "stage3_gather_16bit_weights_on_model_save", I,
        "engine.save_16bit_model() always writes full weights"),
    Key(Z + "elastic_checkpoint", I, "shardwise checkpoints load at any world size"),
    Key(Z + "ignore_unused_parameters", H, "false: a step where a parameter got no gradient raises (stages >= 2)"),
    Key(Z + "log_trace_cache_warnings", I, _LOG),
    Key(Z + "enable_sanity_checks", I, "debug checks"),
    Key(Z + "leaf_module", I, "stage-3 fetch granularity; " + _PERF, subtree=True),
    Key(OO + "nvme_path", H, "device nvme: the folder of the swap files (checked for room, locked per run, "
        "emptied at exit)"),
    Key(OO + "buffer_count", H, "device nvme: host buffers, each one sub-group's swap file and its gradient "
        "(the host bytes held)"),
    Key(OO + "pipeline_read", H, "device nvme: read the next groups while one steps"),
    Key(OO + "pipeline_write", H, "device nvme: write a group while the next steps, the last ones during the "
        "next forward"),
    *(Key(OO + k, I, "partial offload tuning; " + _PERF) for k in (
        "fast_init", "ratio", "super_offload", "cpuadam_cores_perc")),
    Key(OP + "nvme_path", H, "device nvme: the folder of the parameters' swap files (checked, locked, emptied)"),
    Key(OP + "buffer_count", H, "device nvme: aligned host buffers every parameter read and write passes through"),
    Key(OP + "buffer_size", H, "device nvme: elements of one buffer (a larger shard moves in pieces)"),
    Key(OP + "max_in_cpu", H, "device nvme: elements of shards kept in host memory (the first groups), the rest "
        "on disk"),
    Key("zero_allow_untested_optimizer", I, "a DeepSpeed safety switch; any torch optimizer works "
        "(non-elementwise ones on whole tensors, [optimizers.md](optimizers.md))"),
    Key("zero_force_ds_cpu_optimizer", I, "DeepSpeed's CPU Adam kernel choice"),
    # -- tensor parallelism ---------------------------------------------------------------------------
    Key("tensor_parallel", H, "section"),
    Key(TP + "autotp_size", H, "tensor-parallel size (0 = 1)"),
    Key(TP + "tp", H, "section (inference-style spelling)"),
    Key(TP + "tp.tp_size", H, "tensor-parallel size; must agree with autotp_size"),
    Key(TP + "tp.enabled", I, "the size decides"),
    Key(TP + "tp.tp_grain_size", I, "sharding granularity; " + _PERF),
    Key(TP + "tp.mpu", I, "an object, not JSON"),
    Key(TP + "tp.tp_group", I, "an object, not JSON"),
    Key(TP + "tp_overlap_comm", I, _PERF),
    Key(TP + "dtype", I, "the compute dtype comes from fp16/bf16"),
    Key(TP + "partition_config", R, "custom AutoTP partition_config", default()),
    Key(TP + "injection_policy_tuple", R, "AutoTP injection policies", default()),
    Key(TP + "preset_model", I, "shardwise picks the model's own TP plan"),
    Key(TP + "keep_module_on_host", I, _PERF),
    Key(TP + "replace_with_kernel_inject", R, "kernel injection", default(False)),
    Key(TP + "kernel_inject", R, "kernel injection", default(False)),
    Key("sequence_parallel_size", H, "Ulysses sequence parallelism over groups of consecutive ranks "
        "(with tensor_parallel, ranks of one TP rank: TP x SP x DP; shardwise/sequence_parallel/, "
        "docs/long_context.md)"),
    Key("expert_parallel", H, "section: expert parallelism for HF MoE models ([moe.md](moe.md))"),
    Key(EP + "enabled", H, "expert parallelism on (DeepSpeed AutoEP's switch)"),
    Key(EP + "autoep_size", H, "ranks each MoE layer's experts are split over (consecutive ranks)"),
    Key(EP + "preset_model", H, "model family, checked against the model's model_type"),
    Key(EP + "comm_backend", R, "DeepEP token exchange", default("comm")),
    Key(EP + "load_balance_coeff", R, "auxiliary-loss-free load balancing (expert bias)", default()),
    Key(EP + "gate_up_impl", I, "gate/up as one or two matmuls: same math; " + _PERF),
    Key(EP + "row_weighting_impl", I, "a fused kernel for the routing weights: same math; " + _PERF),
    *(Key(EP + k, I, "DeepEP tuning; " + _PERF) for k in ("comm_num_sm", "comm_qp_margin",
                                                          "comm_max_tokens_per_rank")),
    Key("use_data_before_expert_parallelism", I, "used only with MoE"),
    Key("pipeline", H, "read by shardwise/pipeline/, not the loader: `stages` cuts a Hugging Face model "
        "(shardwise.initialize, `shardwise train --pp`); a PipelineModule's engine reads `schedule` "
        "(1f1b, gpipe, interleaved_1f1b, zb_h1; "
        "shardwise's); DeepSpeed's other keys are the module's arguments ([pipeline.md](pipeline.md))",
        subtree=True),
    # -- features not implemented --------------------------------------------------------------------
    Key("compile", R, "DeepCompile (compile.deepcompile)", _off("deepcompile"), subtree=True),
    Key("data_efficiency", R, "data efficiency (curriculum sampling, random-LTD)", _off("enabled"),
        subtree=True),
    Key("curriculum_learning", R, "curriculum learning", disabled, subtree=True),
    Key("progressive_layer_drop", R, "progressive layer drop", disabled, subtree=True),
    Key("compression_training", R, "compression training", disabled, subtree=True),
    Key("quantize_training", R, "quantization-aware training", disabled, subtree=True),
    Key("weight_quantization", R, "post-init weight quantization", default(), subtree=True),
    Key("sparse_attention", R, "sparse attention", default(), subtree=True),
    Key("eigenvalue", R, "eigenvalue computation (for quantization)", disabled, subtree=True),
    Key("hybrid_engine", R, "the RLHF hybrid engine", disabled, subtree=True),
    Key("elasticity", R, "elastic batch sizes", disabled, subtree=True),
    Key("nebula", R, "Nebula checkpointing", disabled, subtree=True),
    Key("datastates", R, "DataStates checkpointing", disabled, subtree=True),
    Key("datastates_ckpt", H, "DataStates' switch (on for any value but false): asynchronous saves, as "
        "checkpoint.writer.decoupled ([checkpoints.md](checkpoints.md))", subtree=True),
    Key("graph_harvesting", I, "CUDA graph capture; " + _PERF),
    Key("checkpoint", H, "section"),
    Key("checkpoint.load_universal", R, "loading DeepSpeed universal checkpoints", default(False)),
    Key("checkpoint.tag_validation", H, "Ignore, Warn (default) or Fail when ranks pass different tags to "
        "save_checkpoint", lambda v, _r: v is None or (isinstance(v, str) and v.lower() in ("ignore", "warn", "fail"))),
    Key("checkpoint.use_node_local_storage", I, "where DeepSpeed writes; shardwise writes to save_dir"),
    Key("checkpoint.parallel_write", I, "checkpoint write pipelining; " + _PERF, subtree=True),
    Key("checkpoint.checkpoint_serialization", I, "DeepSpeed's torch.save format; shardwise writes safetensors"),
    Key("checkpoint.writer", H, "section: DeepSpeed's checkpoint writer"),
    Key("checkpoint.writer.decoupled", H, "true: asynchronous saves, written in the background and "
        "published once durable ([checkpoints.md](checkpoints.md))"),
    *(Key("checkpoint.writer." + k, I, "DeepSpeed's writer engine tuning; " + _PERF)
      for k in ("type", "io_buffer_size", "io_buffer_double", "show_statistics", "data_parallel", "io_multiplier")),
    Key("aio", H, "NVMe offload's I/O engine: block_size, queue_depth, intra_op_parallelism (= thread_count), "
        "single_submit, overlap_events; use_gds true refused; [offload.md](offload.md)", subtree=True),
    Key("activation_checkpointing", I, "configures deepspeed.checkpointing, called by the model; "
        "recomputation gives the same numbers", subtree=True),
    # -- logging, monitoring, profiling, launch -------------------------------------------------------
    *(Key(k, H, note, subtree=True) for k, note in (  # shardwise/monitor/, docs/monitoring.md
        ("tensorboard", "TensorBoard events in output_path/job_name (rank 0)"),
        ("wandb", "a W&B run (rank 0; WANDB_MODE=offline works)"),
        ("csv_monitor", "one CSV file per tag in output_path/job_name (rank 0)"),
        ("comet", "a Comet experiment (needs comet_ml: pip install 'shardwise[monitor]')"),
        ("comms_logger", "per-collective counts, sizes, latency, bandwidth; deepspeed.comm.log_summary()"),
        ("flops_profiler", "the model profile at profile_step (full parameters at ZeRO-3), fwd+bwd FLOPs, MFU"))),
    Key("wall_clock_breakdown", H, "fwd / bwd / bwd_inner / bwd_allreduce / step times per step (rank 0)"),
    Key("memory_breakdown", H, "memory lines before and after forward, backward and step (rank 0)"),
    Key("timers", I, _LOG, subtree=True),
    *(Key(k, I, _LOG) for k in ("dump_state", "log_level")),
    Key("autotuning", I, "read by DeepSpeed's autotuner launcher, not at training time", subtree=True),
    Key("vocabulary_size", I, "used only by DeepSpeed's 1-bit optimizers (refused)"),
    Key("cuda_visible_devices", I, "the launcher chooses devices"),
    Key("dist_init_required", I, "an initialize() argument; shardwise joins the job when needed"),
    # -- shardwise's own keys (DeepSpeed ignores unknown top-level keys) -------------------------------
    Key("shardwise", H, "section: shardwise-only settings"),
    Key("shardwise.timeout_s", H, "collective timeout in seconds (init_distributed(timeout=); "
        "overrides SHARDWISE_TIMEOUT)"),
    Key("shardwise.quantized_gradient_bits", H, "8 (default) or 4: integer width of "
        "`zero_optimization.zero_quantized_gradients`"),
    Key("shardwise.max_nonfinite_steps", H, "0 (default): a non-finite gradient norm without an fp16 loss scaler "
        "stops training (NonFiniteError); N: the first N such steps are skipped instead"),
    Key("shardwise.peak_tflops", H, "the accelerator's peak TFLOPS for the FLOPs profiler's MFU (known GPUs "
        "need none)"),
    Key("shardwise.offload_activation_checkpoints", H, "true: the inputs HF activation checkpointing keeps for "
        "each layer's recompute are held in host memory (pinned) until backward; needs checkpointing on "
        "(docs/long_context.md)"),
    Key("shardwise.sequence_parallel_attention", H, "\"auto\" (default): Ulysses when it can split the "
        "heads over `sequence_parallel_size`, ring attention otherwise; \"ulysses\" or \"ring\" to choose "
        "([long_context.md](long_context.md))"),
    Key("shardwise.async_checkpoint", H, "true: saves return once the state is copied and are written in "
        "the background ([checkpoints.md](checkpoints.md)); false: synchronous whatever DeepSpeed's keys say; "
        "default: DeepSpeed's keys (shardwise train: true)"),
    Key("shardwise.keep_checkpoint_buffer", H, "true: an asynchronous save's host copy of the state is kept "
        "for the next save (one copy held all run; the call about 5x shorter on the CPU) instead of freed "
        "after its write ([checkpoints.md](checkpoints.md#asynchronous-saves))"),
    Key("shardwise.master_update", H, "how a bf16/fp16 master takes its update: \"kahan\" (default: a "
        "compensation buffer keeps what rounding lost), \"stochastic\" (bf16 only) or \"nearest\" "
        "([precision.md](precision.md))", master_update_ok),
)

BY_PATH: dict[str, Key] = {k.path: k for k in KEYS}
if len(BY_PATH) != len(KEYS):  # pragma: no cover - a duplicated row is a bug in this file
    raise RuntimeError("duplicate rows in shardwise.config.keys.KEYS")


def children(path: str) -> dict[str, Key]:
    """Direct sub-keys of a section ('' = top level), by name."""
    prefix = path + "." if path else ""
    return {k.path[len(prefix):]: k for k in KEYS
            if k.path.startswith(prefix) and "." not in k.path[len(prefix):]}


def markdown() -> str:
    """The key table of docs/config.md, generated from KEYS."""
    lines = ["| key | status | what shardwise does |", "|---|---|---|"]
    for k in sorted(KEYS, key=lambda k: k.path):
        path = f"`{k.path}`" + (" (and every sub-key)" if k.subtree else "")
        status = {"honoured": "honoured", "ignored": "ignored (harmless)", "refused": "refused"}[k.status]
        if k.status == "honoured" and k.accepts is not None:
            status = "honoured (some values refused)"
        note = k.note if k.status != "refused" else f"not implemented: {k.note}; accepted only when off"
        lines.append(f"| {path} | {status} | {note} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m shardwise.config.keys --markdown")
    sys.stdout.write(markdown())
