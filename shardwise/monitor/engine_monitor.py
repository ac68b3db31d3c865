"""What the engine reports while it trains: the one object its forward, backward and step call.

Built from the config's sections (``tensorboard``, ``csv_monitor``, ``wandb``, ``comet``,
``wall_clock_breakdown``, ``memory_breakdown``, ``flops_profiler``, ``comms_logger``,
``steps_per_print``); with none of them on, each hook is a few attribute reads.

At each optimizer step (DeepSpeed's accumulation boundary) it writes, from global rank 0, the
events ``Train/Samples/train_loss`` (the mean of the losses given to ``engine.backward`` over the
step's micro-batches and the data-parallel ranks), ``Train/Samples/lr`` (``get_lr()[0]``),
``Train/Samples/loss_scale`` (fp16) and, when the timers run, ``Train/Samples/elapsed_time_ms_*``,
all at x = the global sample count after the step (``engine.global_samples``). The mean loss and
the token count cost one all-reduce of three numbers over the data-parallel ranks on the steps
that write or print (not counted in ``comm_stats()``, not in the communication log). A step whose
backward was a plain ``loss.backward()`` (no loss handed to the engine) writes no train_loss.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from shardwise.monitor.flops import FlopsProfiler
from shardwise.monitor.flops_report import report
from shardwise.monitor.timers import GLOBAL, MICRO, TAGS, PhaseTimers, memory_lines, memory_now
from shardwise.monitor.writers import Monitors


def _global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def count_tokens(args: tuple, kwargs: dict) -> int:
    """Tokens in a batch: the elements of ``input_ids`` (or the first integer tensor argument), or
    the rows of ``inputs_embeds``; 0 when none is found (the progress line then omits tokens/s)."""
    t = kwargs.get("input_ids")
    embeds = kwargs.get("inputs_embeds")
    if t is None and torch.is_tensor(embeds) and embeds.dim() >= 2:
        return int(embeds.numel() // embeds.shape[-1])
    if t is None:
        t = next((a for a in (*args, *kwargs.values()) if torch.is_tensor(a) and not a.is_floating_point()), None)
    return int(t.numel()) if torch.is_tensor(t) else 0


class EngineMonitor:
    """The monitors, timers, memory lines, FLOPs profiler and progress line of one engine."""

    def __init__(self, engine: Any) -> None:
        cfg = engine.config
        self.engine = engine
        self.rank0 = _global_rank() == 0
        self.monitors = Monitors(cfg, write=self.rank0)
        self.wall = bool(cfg.wall_clock_breakdown)
        self.memory = bool(cfg.memory_breakdown)
        fp = cfg.flops_profiler
        self.profiler = FlopsProfiler(fp, cfg.shardwise.peak_tflops) if fp.enabled else None
        self.timers = PhaseTimers() if self.wall or self.profiler is not None else None
        self.every = int(cfg.steps_per_print or 0)
        self.wall_clock_cache: dict[str, float] = {}
        # where rank 0's lines go (``shardwise train`` hands them to its progress bar on a terminal)
        self.printer: Callable[[str], None] = lambda text: print(text, flush=True)
        self.last_profile: dict[str, Any] | None = None
        self._losses: list[torch.Tensor] = []
        self._tokens = 0  # this rank's tokens since the last progress line
        self._step_timed = False  # whether a phase of the current optimizer step was timed
        self._window = (time.perf_counter(), 0)  # (start, global_steps) of the progress line's window
        # A pipeline's loss is known on its last stage only, and on every stage after the batch: its engine
        # sets ``defer_boundary`` and hands the loss to ``finish_batch`` (rank 0, on stage 0, would otherwise
        # report its stage's backward surrogates as the loss).
        self.defer_boundary = False
        self._deferred = False

    # -- phases --------------------------------------------------------------------------------
    def _say(self, lines: list[str] | str) -> None:
        if self.rank0:
            self.printer("\n".join([lines] if isinstance(lines, str) else lines))

    def _timed(self) -> bool:
        """Whether phases are timed now: always with ``wall_clock_breakdown``; for the FLOPs profiler
        alone only during its profile step, since each timer edge synchronizes the device."""
        if self.timers is None:
            return False
        prof = self.profiler
        return self.wall or (prof is not None and not prof.done
                             and self.engine.global_steps == prof.section.profile_step)

    @contextlib.contextmanager
    def phase(self, name: str, memory_label: str | None = None) -> Iterator[None]:
        """Time ``name`` (a DeepSpeed timer: fwd, bwd, bwd_inner, bwd_allreduce, step) and print the
        memory lines before and after it (``memory_label``: "forward", "backward", "step")."""
        if self.memory and memory_label:
            self._say(memory_lines(f"Engine before {memory_label}"))
        timed = self._timed()
        if timed:
            self._step_timed = True
            self.timers.start(name)
        yield
        if timed:
            self.timers.stop(name)
        if self.memory and memory_label:
            self._say(memory_lines(f"Engine after {memory_label}"))

    @contextlib.contextmanager
    def forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Iterator[None]:
        training = torch.is_grad_enabled() and module.training
        if training:
            self._tokens += count_tokens(args, kwargs)
        prof = self.profiler
        profiling = (training and prof is not None and self.rank0 and self.engine.micro_steps % self.engine.gas == 0
                     and prof.due(self.engine.global_steps))
        if profiling:
            prof.start_forward(module)
        try:
            with self.phase("fwd", "forward"):
                yield
        finally:
            if profiling:
                prof.end_forward()

    @contextlib.contextmanager
    def backward(self, loss: torch.Tensor) -> Iterator[None]:
        self._losses.append(loss.detach().float().reshape(()))
        with self.phase("bwd", "backward"):
            yield

    @contextlib.contextmanager
    def backward_inner(self) -> Iterator[None]:
        prof = self.profiler
        counting = prof is not None and prof.active
        if counting:
            prof.start_backward()
        try:
            with self.phase("bwd_inner"):
                yield
        finally:
            if counting:
                prof.end_backward()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around ``engine.step()``: the step timer, then the boundary's reports."""
        boundary = self.engine.is_gradient_accumulation_boundary()
        with self.phase("step", "step"):
            yield
        self._after_step(boundary)

    # -- reports -------------------------------------------------------------------------------
    def _after_step(self, boundary: bool) -> None:
        if self._step_timed:  # an untimed step leaves the last timed step's values, never zeros
            self.wall_clock_cache = {n: self.timers.ms[n] for n in (MICRO + GLOBAL if self.wall else GLOBAL)}
        if self.wall:
            self._say(f"[Rank 0] {self.timers.line(MICRO)}")
        if self.timers is not None:
            self.timers.reset(MICRO)
        if not boundary:
            return
        if self.defer_boundary:
            self._deferred = True
            return
        self._boundary_reports(None)

    def finish_batch(self, loss: torch.Tensor | None) -> None:
        """A pipeline's boundary reports (progress line, monitors), once its batch's mean loss is known."""
        if self._deferred:
            self._deferred = False
            self._boundary_reports(loss)

    def _boundary_reports(self, loss: torch.Tensor | None) -> None:
        eng = self.engine
        printing = self.every > 0 and eng.global_steps % self.every == 0
        stats = self._reduce_step() if (self.monitors.enabled or printing) else None
        if stats is not None and loss is not None:
            stats = (float(loss), stats[1])
        if self.monitors.enabled and self.rank0:
            self.monitors.write_events(self._events(stats))
        if self.profiler is not None and self.profiler.fwd_flops and not self.profiler.done and self.rank0:
            self._write_profile()
        if self.wall:
            self._say(f"[Rank 0] {self.timers.line(GLOBAL)}")
        if self.timers is not None:
            self.timers.reset(GLOBAL)
        self._step_timed = False
        if printing:
            self._progress(stats)
        self._losses = []

    def _reduce_step(self) -> tuple[float | None, int]:
        """(mean loss of this step over micro-batches and data-parallel ranks, tokens of the window)."""
        eng = self.engine
        total = torch.stack(self._losses).double().sum() if self._losses else torch.zeros((), dtype=torch.float64)
        t = torch.tensor([0.0, len(self._losses), self._tokens], dtype=torch.float64, device=eng.device)
        t[0] = total  # a device copy: no host read of the loss before the all-reduce (one sync, below)
        for comm in (eng.comm, eng.replica):  # the shard group, then the replicas (hybrid sharding)
            comm.all_reduce(t)  # through Comm, so comm_stats() and the comms logger count it
        return (float(t[0] / t[1]) if t[1] > 0 else None), int(t[2])

    def _events(self, stats: tuple[float | None, int]) -> list[tuple[str, float, int]]:
        eng = self.engine
        x = eng.global_samples
        events = [("Train/Samples/train_loss", stats[0], x)] if stats[0] is not None else []
        events.append(("Train/Samples/lr", eng.get_lr()[0], x))
        if eng.fp16_enabled():
            events.append(("Train/Samples/loss_scale", eng.cur_scale, x))
        if self._step_timed:
            events += [(f"Train/Samples/elapsed_time_ms_{TAGS[n]}", self.timers.ms[n], x) for n in GLOBAL]
        return events

    def _write_profile(self) -> None:
        eng, prof = self.engine, self.profiler
        summary = prof.summary(eng.compute_dtype)
        ctx = {"step": prof.section.profile_step, "world": eng.world_size, "dp": eng.dp_world,
               "mp": eng.mp_world_size, "micro": eng.train_micro_batch_size_per_gpu(),
               "step_latency_s": self.timers.ms["step"] / 1e3 if self.timers is not None else None}
        text = report(prof, summary, ctx)
        prof.done = True
        self.last_profile = summary
        out = prof.section.output_file
        if out:
            with open(out, "w") as f:
                f.write(text)
        else:
            sys.stdout.write(text)
            sys.stdout.flush()

    def _progress(self, stats: tuple[float | None, int] | None) -> None:
        eng = self.engine
        start, steps0 = self._window
        now = time.perf_counter()
        seconds, steps = max(now - start, 1e-9), eng.global_steps - steps0
        self._window, self._tokens = (now, eng.global_steps), 0
        loss = f"{stats[0]:.4f}" if stats and stats[0] is not None else "n/a"
        mem = memory_now()
        scale = f" | loss scale {eng.cur_scale:g}" if eng.fp16_enabled() else ""
        norm = eng.get_global_grad_norm()
        tokens = f" | {stats[1] / seconds:,.0f} tokens/s" if stats and stats[1] > 0 else ""
        self._say(f"[shardwise] step {eng.global_steps}: loss {loss} | lr {eng.get_lr()[0]:.3e} | grad norm "
                  f"{norm if norm is None else f'{norm:.3f}'}{scale} | {steps * eng.train_batch_size() / seconds:.2f} "
                  f"samples/s{tokens} | memory {mem['MA']:.2f} GiB (peak "
                  f"{mem['Max_MA']:.2f} GiB, rank 0)")

    def close(self) -> None:
        self.monitors.close()
