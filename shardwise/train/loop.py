"""The pieces of the training loop that touch the engine: one step, eval, stop requests, checkpoints.

Every rank runs the same calls in the same order (stage 3 and TP forwards are collective), and the
ranks agree on stopping through the one all-reduce per step that also averages the loss. The job's
own collectives go through a guarded :class:`shardwise.comm.Comm` of their own (``make_comm()``: a
dead peer is one diverged-ranks error; its bytes are kept out of the engine's ``comm_stats()``).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardwise.checkpoint import wait_for_checkpoint
from shardwise.comm import make_comm
from shardwise.engine import NonFiniteError
from shardwise.sequence_parallel import router_aux_loss, sequence_parallel_loss, split_batch
from shardwise.train import pipeline_job
from shardwise.train.data import TokenData
from shardwise.train.divergence import RankOutOfMemoryError
from shardwise.train.run_folder import prune_checkpoints


class StopRequest:
    """SIGTERM / SIGINT set a flag: the step in flight finishes, then every rank saves and exits 0.

    Later signals are absorbed too: after a Ctrl-C, torchrun sends its own SIGTERM to the workers,
    which must not kill a checkpoint being written (torchrun sends SIGKILL after its grace period).
    """

    def __init__(self) -> None:
        self.signal: int | None = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:  # noqa: ARG002
        if self.signal is None:
            self.signal = signum

    @property
    def requested(self) -> bool:
        return self.signal is not None


@dataclass
class StepResult:
    """One step as every rank saw it: the global mean loss, whether to stop, the data seconds, the
    gradient norm, and whether fp16's loss scaler skipped the step (an overflow, not divergence)."""

    loss: float
    stopped: bool
    data_s: float
    grad_norm: float | None
    loss_scaler_skipped: bool


def micro_loss(engine, mb: torch.Tensor) -> torch.Tensor:
    """The micro-batch's causal-LM loss; under SP this rank's sequence shard, every token counted once,
    plus an MoE model's aux loss over the whole sequence (which HF adds itself when it gets the labels)."""
    sp = engine.sequence_parallel
    if sp is None:
        return engine(input_ids=mb, labels=mb).loss
    batch = {"input_ids": mb, "labels": mb}
    shard = split_batch(batch, sp)
    labels = shard.pop("shift_labels")
    out = engine(**shard)
    return sequence_parallel_loss(out.logits, labels, sp) + router_aux_loss(out, engine.module, batch, sp)


@contextmanager
def out_of_memory_names(phase: str, step: int) -> Iterator[None]:
    """A ``torch.OutOfMemoryError`` in ``phase`` becomes :class:`RankOutOfMemoryError` naming this rank,
    the phase and the step (one line). Only this rank knows: the others stop at their next collective,
    which fails when this rank exits (a :class:`RanksDivergedError` naming the collective), within the
    collective timeout. Nothing of the step is saved; the run folder keeps its last checkpoint."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        rank = dist.get_rank() if dist.is_initialized() else 0
        first = str(e).strip().splitlines()[0] if str(e).strip() else "out of memory"
        raise RankOutOfMemoryError(
            f"rank {rank} ran out of memory in the {phase} of step {step} ({first}); every rank stops, nothing of "
            "this step saved: lower train_micro_batch_size_per_gpu (raise gradient_accumulation_steps), use a "
            "higher ZeRO stage or offload, then continue with --resume auto") from None


def train_step(engine, data: TokenData, step: int, stop: StopRequest) -> StepResult:
    """One optimizer step (all micro-batches).

    The loss is averaged over every micro-batch of every data-parallel rank (the same value at any
    layout), in the same all-reduce that tells every rank whether any of them was asked to stop.
    A non-finite gradient norm past the engine's allowance (:class:`NonFiniteError`, raised on
    every rank alike: the norm is global) still joins that all-reduce, so the report can name the
    loss too; the optimizer has not touched the weights.
    """
    cfg = engine.config
    t0 = time.perf_counter()
    micro = data.micro_batches(step, cfg.train_micro_batch_size_per_gpu, engine.gas, engine.dp_rank,
                               engine.dp_world)
    data_s = time.perf_counter() - t0
    total, norm, mean = 0.0, None, None
    if pipeline_job.is_pipeline(engine):  # a step is one train_batch over the micro-batches: its mean loss
        with out_of_memory_names("forward and backward", step + 1):
            mean, norm = pipeline_job.train_batch(engine, [mb.to(engine.device) for mb in micro])
        micro = []
    for mb in micro:
        mb = mb.to(engine.device)
        with out_of_memory_names("forward", step + 1):
            loss = micro_loss(engine, mb)
        with out_of_memory_names("backward", step + 1):
            engine.backward(loss)
        try:
            with out_of_memory_names("optimizer step", step + 1):
                engine.step()
        except NonFiniteError as e:
            norm = e.value
        total += float(loss.detach())
    flags = torch.tensor([total / engine.gas if mean is None else mean, float(stop.requested)], dtype=torch.float64,
                         device=engine.device)
    make_comm().all_reduce(flags)  # world sum: TP and SP ranks repeat their data-parallel rank's loss, so / world
    scaler_skip = engine.loss_scaler is not None and not engine.was_step_applied()
    return StepResult(float(flags[0]) / dist.get_world_size(), bool(flags[1] > 0), data_s,
                      engine.get_global_grad_norm() if norm is None else norm, scaler_skip)


@torch.no_grad()
def evaluate(engine, data: TokenData) -> float:
    """Mean next-token loss over every held-out sequence (token-weighted, all ranks agree).

    Data-parallel ranks take turns over the eval batches; a rank without a batch in the last round
    runs a forward anyway (discarded), because stage-3 and TP forwards are collective.
    """
    batches = data.eval_batches(engine.config.train_micro_batch_size_per_gpu)
    dp, rank = engine.dp_world, engine.dp_rank  # SP ranks evaluate whole sequences (no_grad: SP is off)
    sums = torch.zeros(2, dtype=torch.float64, device=engine.device)
    if pipeline_job.is_pipeline(engine):
        sums += pipeline_job.eval_sums(engine, [b.to(engine.device) for b in batches])
        batches = []  # the stages' turns are taken; no forward below
    engine.module.eval()
    try:
        for r in range(-(-len(batches) // dp)):
            i = r * dp + rank
            mb = batches[i if i < len(batches) else 0].to(engine.device)
            loss = engine(input_ids=mb, labels=mb).loss
            if i < len(batches):
                n = mb.shape[0] * (mb.shape[1] - 1)  # HF shifts labels: seq-1 predictions per row
                sums += torch.tensor([float(loss) * n, n], dtype=torch.float64, device=engine.device)
    finally:
        engine.module.train()
    make_comm().all_reduce(sums)  # TP and SP ranks add their (equal) sums to numerator and denominator alike
    return float(sums[0] / sums[1])


@torch.no_grad()
def probe_loss(engine, data: TokenData) -> float:
    """The model's loss on the first training sequence, the same on every rank (a forward on each:
    stage-3 and TP forwards are collective; the all-reduce makes the ranks agree bit for bit).

    Finite weights can still compute a non-finite loss (an lr typo leaves weights near 1e6 that
    overflow a softmax); this one forward before every checkpoint and export catches it even when
    the run holds out no eval data."""
    mb = torch.from_numpy(data.sequence(0))[None, :].to(engine.device)
    engine.module.eval()
    try:
        pipe = pipeline_job.is_pipeline(engine)
        loss = pipeline_job.probe(engine, mb) if pipe else engine(input_ids=mb, labels=mb).loss
    finally:
        engine.module.train()
    out = torch.tensor([float(loss)], dtype=torch.float64, device=engine.device)
    make_comm().all_reduce(out)
    return float(out[0]) / dist.get_world_size()


@torch.no_grad()
def sample(engine, tokenizer, prompt_ids: list[int], max_new_tokens: int, seed: int, guard: Any = None) -> str:
    """Text from the trained model (same seed on every rank, so TP / stage-3 ranks stay in step);
    ``guard``: a logits processor run on every step's logits (``divergence.FiniteLogits``)."""
    from transformers import LogitsProcessorList

    torch.manual_seed(seed)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=engine.device)
    engine.module.eval()
    try:
        pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        out = engine.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                              do_sample=True, top_k=40, temperature=0.8, pad_token_id=pad,
                              **({"logits_processor": LogitsProcessorList([guard])} if guard is not None else {}))
    finally:
        engine.module.train()
    return tokenizer.decode(out[0].tolist())


def save(engine, ckpt_dir: Path, step: int, client_state: dict, keep: int, wait: bool = False) -> str:
    """Checkpoint ``global_step{step}`` (collective); rank 0 then deletes all but the ``keep``
    written last (never the one ``latest`` names: :func:`run_folder.prune_checkpoints`).

    Asynchronous unless the config's ``shardwise.async_checkpoint`` is false: the call returns once
    the state is copied and training goes on while it is written (docs/checkpoints.md). ``wait``
    (the last step's and a stop's save): published before returning. Until then ``latest`` names
    the previous complete checkpoint, which the pruning therefore keeps."""
    own = engine.config.shardwise.async_checkpoint
    path = engine.save_checkpoint(ckpt_dir, tag=f"global_step{step}", client_state=client_state,
                                  asynchronous=True if own is None else own)
    if wait:
        wait_for_checkpoint()
    if dist.get_rank() == 0:
        prune_checkpoints(ckpt_dir, keep)
    return path
