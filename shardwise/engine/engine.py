"""The DeepSpeed-compatible engine: a thin shell over the functional core.

config -> :func:`options_from_config` -> :func:`shardwise.fsdp.shard_module` (the same construction
``shardwise.shard`` uses) -> DeepSpeed's loop helpers: ``backward`` (1/gas and fp16 loss scaling,
accumulation boundaries, ``no_sync``), ``step`` (overflow skip, clipping, optimizer and scheduler),
reports and checkpoints. It owns no sharding logic: the groups, their reductions and the end of
each backward live in :class:`~shardwise.zero.builder.Sharding`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.checkpoint import load_checkpoint, poll_checkpoint, save_16bit_model, save_checkpoint
from shardwise.comm import configure as configure_comms_log
from shardwise.engine.checks import check_all_used, check_save_args, direct_step_guard, track_used
from shardwise.engine.compat import EngineAccessors, UsageError
from shardwise.engine.memory import memory_report
from shardwise.engine.nonfinite import skip_nonfinite_step
from shardwise.engine.nvme import (
    attach_nvme,
    attach_param_swap,
    clip_grads,
    nvme_resident,
    nvme_streamed,
    reduce_and_norm,
    swaps_closed_on_failure,
)
from shardwise.engine.plain_backward import plain_backward_rule, scale_loss
from shardwise.fsdp.compiled import compile_sharded
from shardwise.fsdp.module import shard_module
from shardwise.layout import RunLayout
from shardwise.moe import expert_parallel_of
from shardwise.monitor import EngineMonitor
from shardwise.optim.loss_scale import DynamicLossScaler
from shardwise.optim.optimizers import build_optimizer, config_optimizer_class, rebuild_client_optimizer
from shardwise.optim.schedules import build_scheduler
from shardwise.sequence_parallel import setup_long_context
from shardwise.units import ByteCounts
from shardwise.zero.bucket_step import require_elementwise, step_and_publish
from shardwise.zero.builder import ShardOptions
from shardwise.zero.policy import PrecisionPolicy
from shardwise.zero.whole_tensor import build_on_sharding

log = logging.getLogger("shardwise")


def options_from_config(config) -> ShardOptions:
    """The DeepSpeed config's ``zero_optimization`` section as the builder's options."""
    zero = config.zero_optimization
    # nvme: the masters made straight into their swap files, a piece at a time (engine/nvme.py)
    off_opt = zero.offload_optimizer is not None and zero.offload_optimizer.device in ("cpu", "nvme")
    off_param = zero.offload_param.device in ("cpu", "nvme")  # nvme: the stores of engine/nvme.py
    return ShardOptions(
        stage=config.zero_stage,
        bucket_numel=int(min(zero.reduce_bucket_size, zero.allgather_bucket_size)),
        persistence_threshold=int(zero.stage3_param_persistence_threshold),
        prefetch_numel=int(zero.stage3_prefetch_bucket_size),
        max_live_numel=int(zero.stage3_max_live_parameters),
        offload_optimizer=off_opt, offload_param=off_param,
        master_later=off_opt and zero.offload_optimizer.device == "nvme",  # made into the swap files
        pin_memory=bool((off_opt and zero.offload_optimizer.pin_memory)
                        or (off_param and zero.offload_param.pin_memory)),
        overlap_comm=bool(zero.overlap_comm),
        weight_bits=8 if zero.zero_quantized_weights else 0,  # ZeRO++ qwZ / qgZ: zero/quantized_comm.py
        grad_bits=config.shardwise.quantized_gradient_bits if zero.zero_quantized_gradients else 0,
        grad_accum_dtype=config.grad_accum_dtype,
        precision=PrecisionPolicy(*config.master_dtypes[:1], state_dtype=config.master_dtypes[1],
                                  master_update=config.shardwise.master_update),
    )


def optimizer_recipe(config, client, rank: int) -> tuple[Callable[[list[dict]], Any], type | None] | None:
    """How the optimizer will be made, settled from the config and the arguments before ZeRO shards:
    ``(make(groups), class or None)`` for ``build_on_sharding``, or None (no optimizer).

    DeepSpeed's rules: a client optimizer (or factory) wins over the config's ``optimizer`` section;
    with neither the engine is for evaluation only."""
    if client is not None:
        if config.optimizer is not None and rank == 0:
            log.warning("optimizer= was passed to initialize(): the config's `optimizer` section "
                        f"({config.optimizer.type}) is ignored, as DeepSpeed does")
        kind = type(client) if isinstance(client, torch.optim.Optimizer) else None  # None: a factory
        return functools.partial(rebuild_client_optimizer, client), kind
    if config.optimizer is None:
        return None
    opt_type = config.optimizer.type
    return functools.partial(build_optimizer, opt_type, dict(config.optimizer.params)), config_optimizer_class(opt_type)


def scheduler_recipe(config, client) -> Callable[[torch.optim.Optimizer], Any] | None:
    """How the LR scheduler will be made from the optimizer, settled before ZeRO shards: a client
    factory, a client scheduler (checked against the optimizer), the config's ``scheduler`` section,
    or None (no scheduler)."""
    if client is not None:
        if callable(client) and not hasattr(client, "step"):
            return client
        return functools.partial(client_scheduler, client)
    if config.scheduler is None:
        return None
    return functools.partial(build_scheduler, config.scheduler.type, dict(config.scheduler.params))


def client_scheduler(client, optimizer: torch.optim.Optimizer):
    """A scheduler the script built: it must drive the optimizer the engine returns."""
    if getattr(client, "optimizer", optimizer) is not optimizer:
        raise UsageError("lr_scheduler= was built on another optimizer than the one passed as "
                         "optimizer=; build it on that optimizer or pass a callable "
                         "(lambda opt: Scheduler(opt, ...))")
    return client


class Engine(EngineAccessors, nn.Module):
    """DeepSpeed-style engine around ``module`` (the contract: docs/deepspeed_api.md)."""

    @swaps_closed_on_failure  # a constructor that raises releases the NVMe swap folders' locks at once
    def __init__(self, model: nn.Module, config, model_parameters=None, optimizer=None,
                 lr_scheduler=None, model_is_tp: bool = False, layout: RunLayout | None = None):
        """``layout``: the run's groups, cut once (``shardwise/layout/``; None: from the config), counted in
        ``comm_stats()``. ``model_is_tp``: the script split the model over TP already (DeepSpeed's ``mpu``)."""
        super().__init__()
        self.config = config
        configure_comms_log(config)  # comms_logger: from the first collective on, as DeepSpeed (comm/log.py)
        self.layout = layout if layout is not None else RunLayout.from_config(config)
        mesh = self.layout.mesh
        self.comm, self.tp, self.replica = mesh.dp, mesh.tp, mesh.replicate
        # data-parallel replicas (sampler, batch rule): ZeRO shards over SP x DP ranks; one SP group, one sample set
        self.dp_world, self.dp_rank = self.layout.data_parallel(config.sequence_parallel_size)
        self.gas = config.gradient_accumulation_steps
        self.micro_steps = self.global_steps = self.skipped_steps = 0
        self.nonfinite_steps = 0  # non-finite gradient norms without a loss scaler (shardwise.engine.nonfinite)
        self.max_nonfinite_steps = config.shardwise.max_nonfinite_steps
        self._in_no_sync = False
        self._last_loss: torch.Tensor | None = None
        self.last_grad_norm: float | None = None
        self.compute_dtype: torch.dtype = config.compute_dtype
        # settled from the config before anything is sharded; what needs the shards is made after
        options = attach_param_swap(self, options_from_config(config), model)  # offload_param nvme (engine/nvme.py)
        self.offload_optimizer, self.offload_param = options.offload_optimizer, options.offload_param
        make_optimizer = optimizer_recipe(config, optimizer, self.comm.rank)
        make_scheduler = scheduler_recipe(config, lr_scheduler)
        step_guard = direct_step_guard(self)
        self.sharding = sh = shard_module(model, options, self.comm, self.replica, self.tp, mesh.secondary,
                                          compute_dtype=self.compute_dtype, model_parameters=model_parameters,
                                          optimizer=optimizer, tp_plan=False if model_is_tp else "auto")
        self.module = model
        # SP (Ulysses or ring attention) and ALST's checkpoint offload (None without each), docs/long_context.md
        self.sequence_parallel, self.checkpoint_offload = setup_long_context(model, self.layout.sequence,
                                                                             config.shardwise)
        # gradient_allreduce_op: "mean" averages gradients over data-parallel ranks, "sum" adds them
        self.gradient_average = config.gradient_allreduce_op == "mean"
        self.tp_report, self.policy, self.units, self.fetcher = sh.tp_report, sh.policy, sh.units, sh.fetcher
        self.groups_by_pg, self.unit_groups, self.groups = sh.groups_by_pg, sh.unit_groups, sh.groups

        master_groups = [{**opts, "params": [g.master for g in gs]}
                         for opts, gs in zip(sh.param_groups, self.groups_by_pg, strict=True)]
        built = None if make_optimizer is None else build_on_sharding(sh, master_groups, *make_optimizer)
        self.optimizer = require_elementwise(built, sh, config.precision)
        if self.optimizer is not None:
            self.optimizer.register_step_pre_hook(step_guard)
            self.optimizer.overflow = False  # DeepSpeed's ZeRO optimizers' flag: the last step was skipped
        self.nvme = attach_nvme(self)  # offload_optimizer.device nvme: master and state to swap files
        no_scheduler = self.optimizer is None or make_scheduler is None  # DeepSpeed: none without an optimizer
        self.lr_scheduler = None if no_scheduler else make_scheduler(self.optimizer)

        self.fp16 = config.precision == "fp16"
        self.loss_scaler = DynamicLossScaler.from_fp16_config(config.fp16) if self.fp16 else None
        self._grads_reduced = False
        self.is_compiled = False  # engine.compile() was called
        self.manual_scale_pending = False  # engine.scale(loss) was called; its backward is next
        this = weakref.ref(self)
        sh.plain_backward = lambda: plain_backward_rule(this())  # a loss.backward() the engine did not start
        for g in self.groups + [g for gs in self.unit_groups for g in gs]:
            g.engine_ref = weakref.ref(self)  # shardwise.utils.safe_get_* find the engine from a param
        self.monitor = EngineMonitor(self)  # monitors, timers, FLOPs profiler, progress line (shardwise/monitor/)

    # -- construction ---------------------------------------------------------------
    def wait_for_params(self) -> None:
        """Finish the asynchronous all-gathers of the last step (before reading parameters)."""
        self.sharding.wait_for_params()

    # -- forward / backward ---------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.monitor.forward(self.module, args, kwargs):
            return self.module(*args, **kwargs)

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether this micro-batch ends the accumulation window (reduce, then step)."""
        forced = getattr(self, "_forced_boundary", None)
        return forced if forced is not None else (self.micro_steps + 1) % self.gas == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Override the boundary for the next forward/backward (DeepSpeed's manual accumulation:
        False for all micro-batches but the last, True for it, then one ``step()``)."""
        self._forced_boundary = bool(is_boundary)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient reduction in this context (stages 0 and 1 only: grads stay whole).

        As DeepSpeed: refused at stages 2-3, not reentrant, and ``step()`` is illegal inside.
        """
        if self.policy.shard_grads:
            raise UsageError(f"no_sync context manager is incompatible with gradient partitioning logic of "
                             f"ZeRO stage {self.stage}: gradients are reduce-scattered during backward; "
                             "use gradient_accumulation_steps instead")
        if self._in_no_sync:
            raise UsageError("no_sync context manager reentry is unsupported (already inside no_sync())")
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False

    def _require_optimizer(self, what: str) -> None:
        if self.optimizer is None:
            raise UsageError(f"must provide optimizer during init in order to use {what}: this engine was "
                             "built without optimizer= or a config `optimizer` section (evaluation only)")

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss`` scaled for accumulation (1/gas) and fp16 loss scaling.

        Returns the loss divided by the accumulation steps (as DeepSpeed), or ``loss`` unchanged
        with ``scale_wrt_gas=False`` (which also skips the 1/gas scaling of the gradients).
        """
        self._require_optimizer("backward")
        track_used(self)
        reduce_now = self.is_gradient_accumulation_boundary() and not self._in_no_sync
        self.sharding.arm(reduce_now)
        scale = 1.0 / self.gas if scale_wrt_gas else 1.0
        if self.loss_scaler is not None:
            scale *= self.loss_scaler.scale
        # The sharding's autograd callback finishes the groups when this backward completes; the
        # call after it only acts when no hook fired (a loss that reached no sharded parameter).
        with self.monitor.backward(loss):
            with self.monitor.backward_inner():
                (loss * scale).backward(retain_graph=retain_graph)
            with self.monitor.phase("bwd_allreduce"):
                self.sharding.finish_backward()
        self._grads_reduced = reduce_now
        self._last_loss = loss.detach()
        return loss / self.gas if scale_wrt_gas else loss

    def compile(self, backend: Any = "inductor", compile_kwargs: dict | None = None, schedule: Any = None,
                compiled_autograd_enabled: bool = False) -> None:
        """DeepSpeed's ``engine.compile()`` (as the HF Trainer calls it): ``torch.compile`` of the model
        for its stage (``shardwise/compiled.py``). DeepCompile's ``schedule`` / compiled autograd are refused."""
        if schedule is not None or compiled_autograd_enabled:
            raise UsageError("engine.compile(schedule=..., compiled_autograd_enabled=True): DeepCompile passes "
                             "are not supported; call engine.compile(backend=..., compile_kwargs=...)")
        compile_sharded(self.module, self.sharding, backend, compile_kwargs)
        self.is_compiled = True

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """DeepSpeed's ``engine.scale(loss)``: the fp16-scaled loss, for ``engine.scale(loss).backward()``."""
        return scale_loss(self, loss)

    # -- step -----------------------------------------------------------------------
    def step(self) -> None:
        """Call after every micro-batch; steps and zeroes grads at the accumulation boundary."""
        boundary = self.is_gradient_accumulation_boundary()
        with self.monitor.step():  # the step timer, then the boundary's events, profile and progress line
            self._step()
        if boundary:  # as DeepSpeed commits a decoupled save: not a collective (GPU: a sync) every micro-batch
            poll_checkpoint()  # a pending asynchronous save is published once every rank wrote it

    def _step(self) -> None:
        if self._in_no_sync:
            raise UsageError("It is illegal to call Engine.step() inside no_sync context manager: "
                             "leave no_sync() for the last micro-batch, then step()")
        self._require_optimizer("step")
        if not self.is_gradient_accumulation_boundary():
            self.micro_steps += 1
            return
        check_all_used(self)
        # over every rank ZeRO reduced over (SP x DP): each SP rank's loss is the whole loss (docs/long_context.md)
        unscale = 1.0 / self.sharding.dp_world if self.gradient_average else 1.0
        if self.loss_scaler is not None:
            unscale /= self.loss_scaler.scale
        grads, norm = reduce_and_norm(self, unscale)  # NVMe offload: no gradient held on the host (engine/nvme.py)
        overflow = not math.isfinite(norm)
        skip = self.loss_scaler.update(overflow) if self.loss_scaler is not None else False
        if overflow and self.loss_scaler is not None:
            if dist.get_rank() == 0 if dist.is_initialized() else True:
                log.warning(self.loss_scaler.overflow_message(self.global_steps))
        if overflow and self.loss_scaler is None:  # divergence: stop, or skip within the allowance
            skip = skip_nonfinite_step(self, norm)
        if not skip:
            clip = self.config.gradient_clipping
            if clip and clip > 0:
                coef = min(1.0, clip / (norm + 1e-6))
                if coef < 1.0:
                    clip_grads(self, grads, coef)
            self._engine_stepping = True
            try:  # stages 1-2: each bucket's all-gather overlaps the next one's step; done before step() returns
                if self.nvme is not None:  # group by group through the swap files
                    self.nvme.step_and_publish(self.sharding)
                else:
                    step_and_publish(self.optimizer, self.sharding)
            finally:
                self._engine_stepping = False
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        else:
            self.skipped_steps += 1
        self._step_applied = not skip
        self.optimizer.overflow = skip
        self.last_grad_norm = norm
        self.sharding.zero_grad()
        self.global_steps += 1
        self.micro_steps += 1

    # -- inference ------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, *args: Any, gather_whole_model: bool | None = None, **kwargs: Any) -> Any:
        """HF ``generate()`` at every stage.

        At stage 3 the whole model is gathered once when it fits (default: when the full
        16-bit weights take under half of the free accelerator memory, always on CPU), so
        decoding costs no communication; otherwise units are gathered per forward with
        prefetch and ``synced_gpus=True`` keeps every rank running the same number of forward
        calls even when its sequences finish early.
        """
        if expert_parallel_of(self.module) is not None and self.comm.size > 1:
            kwargs.setdefault("synced_gpus", True)  # every forward exchanges tokens between the EP ranks
        if self.fetcher is None:
            return self.module.generate(*args, **kwargs)
        if gather_whole_model is None:
            gather_whole_model = self._whole_model_fits()
        if not gather_whole_model:
            kwargs.setdefault("synced_gpus", self.dp_world > 1)
            return self.module.generate(*args, **kwargs)
        self.fetcher.gather_all()
        try:
            return self.module.generate(*args, **kwargs)
        finally:
            self.fetcher.release_all()

    def _whole_model_fits(self) -> bool:
        if not torch.cuda.is_available():
            return True
        full = sum(g.padded_numel * g.flat_param.element_size() for gs in self.unit_groups for g in gs)
        free, _ = torch.cuda.mem_get_info()
        return full < free / 2

    def zero_grad(self) -> None:
        self.sharding.zero_grad()
        self._grads_reduced = False

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds now, by kind (tensor bytes, not RSS): ``engine/memory.py``."""
        return memory_report(self)

    def comm_stats(self) -> dict[str, int]:
        """Bytes this rank moved per collective kind since start, over every group of the run's layout
        (SP's ``all_to_all_sequence`` and EP's ``all_to_all_ep`` included; see shardwise.comm)."""
        return ByteCounts(self.layout.stats.as_dict())

    # -- checkpoints (implemented in shardwise.checkpoint; these only delegate) -------
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False, asynchronous: bool | None = None) -> str:
        """Sharded checkpoint of model, optimizer, scheduler, counters and RNG (collective).

        ``exclude_frozen_parameters=True`` (DeepSpeed's): frozen parameters are not written, only
        listed; a load leaves them as the model it loads into has them. ``asynchronous`` (None: the
        config's ``shardwise.async_checkpoint`` / DeepSpeed's writer keys): return once the state is
        copied, written in the background (docs/checkpoints.md).
        """
        tag = check_save_args(self, save_dir, tag)
        with nvme_streamed(self):  # NVMe-held state read a group at a time by the writer (engine/nvme.py)
            return save_checkpoint(self, save_dir, tag=tag, client_state=client_state, save_latest=save_latest,
                                   exclude_frozen_parameters=exclude_frozen_parameters, asynchronous=asynchronous)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False) -> tuple[str | None, dict | None]:
        """Load a checkpoint saved at any world size / stage; returns ``(path, client_state)``."""
        for g in self.groups + [g for gs in self.unit_groups for g in gs]:
            g.drop_secondary()  # hpZ: the loaded parameters replace what the secondary shards hold
        with nvme_resident(self, write_back=True):
            return load_checkpoint(self, load_dir, tag=tag, load_optimizer_states=load_optimizer_states,
                                   load_lr_scheduler_states=load_lr_scheduler_states,
                                   load_module_only=load_module_only, load_module_strict=load_module_strict)

    def save_16bit_model(self, save_dir, save_filename=None, max_shard_size="5GB") -> bool:  # noqa: ARG002
        """HF-format weights (config.json + model*.safetensors) in the compute dtype (collective).
        Returns True, as DeepSpeed's does when it saved (it never skips: no gather flag is needed)."""
        save_16bit_model(self, save_dir, max_shard_size=max_shard_size)
        return True
