"""`shardwise train`: the main job, from options to the exported model.

Order of work: options -> model source and tokenizer -> token file (rank 0 writes, all map it) ->
model (under zero.Init at stage 3) -> engine -> resume -> steps (metrics, eval, checkpoints, stop on
SIGTERM/SIGINT) -> final eval, sample, hf/ export, loss.png, memory table.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from shardwise.checkpoint import wait_for_checkpoint
from shardwise.checkpoint.formats import is_foreign
from shardwise.checkpoint.run_files import RUN_TOKENIZER
from shardwise.comm import RanksDivergedError, make_comm
from shardwise.config import ConfigError, SupportedFeatures, load_config
from shardwise.errors import UserError, one_line, user_error_types
from shardwise.train import loop, pipeline_job
from shardwise.train.advice import eval_rise_note, passes_note
from shardwise.train.data import DataError, TokenData, list_sources, tokenize_to_cache
from shardwise.train.defaults import SUMMARY
from shardwise.train.divergence import (
    EXIT_DIVERGED,
    EXIT_RANK_FAILED,
    DivergedError,
    FiniteLogits,
    NonFiniteGuard,
    RankOutOfMemoryError,
    nonfinite_values,
)
from shardwise.train.export import write_side_files
from shardwise.train.hf_datasets import dataset_kind, dataset_to_jsonl
from shardwise.train.model import ModelError, ModelSource, build_model, load_tokenizer, n_params, resolve_model
from shardwise.train.outputs import MetricsLog, memory_table, perplexity, plot_loss, read_metrics, resolved
from shardwise.train.run_folder import RunLock
from shardwise.units import human_counts


def _prepare_data(args, tokenizer, run_dir: Path) -> Path:
    """Global rank 0 tokenizes (or finds the cache); every rank gets the path or rank 0's error."""
    box: list = [None]
    if dist.get_rank() == 0:
        try:
            data = args.data  # a Hugging Face dataset: its text column as JSONL first (train/hf_datasets.py)
            if dataset_kind(data) is not None:
                data = str(dataset_to_jsonl(data, args.text_key, run_dir / "data"))
            box[0] = str(tokenize_to_cache(list_sources(data), tokenizer, run_dir / "data", args.text_key))
        except DataError as e:
            box[0] = DataError(str(e))
        except Exception as e:  # noqa: BLE001 - the other ranks wait in the broadcast: send it to them
            box[0] = DataError(f"--data {args.data}: tokenizing failed: {type(e).__name__}: {e}")
    make_comm().broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    return Path(box[0])


def _log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(f"[shardwise train] {msg}", flush=True)


def main(args: Any) -> int:
    """Run the job ``args`` describes (``shardwise.cli.train_options.parse_args`` made them); return
    its exit code. The CLI (``shardwise.cli.train``) exits with it; a test's rank calls it in-process.

    A process group this call did not make (a caller's world, a test pool's) is left up and used;
    one it made is destroyed on return. The run folder's lock is released on return either way,
    so the same process may train in that folder again (resume) without a new interpreter.
    """
    import shardwise

    made_group = not dist.is_initialized()
    shardwise.init_distributed(timeout=args.timeout)
    try:
        return _run(args, shardwise)
    except DivergedError as e:  # every rank raises it alike (same loss, same norm)
        if dist.get_rank() == 0:
            print(f"shardwise train: error: {one_line(e)}", file=sys.stderr, flush=True)
        wait_for_checkpoint()  # an earlier step's save still being written: published (every rank is here)
        return EXIT_DIVERGED
    except (RanksDivergedError, RankOutOfMemoryError) as e:  # this rank alone: every rank says its own line
        print(f"shardwise train: error: {one_line(e)}", file=sys.stderr, flush=True)
        os._exit(EXIT_RANK_FAILED)  # the group is unusable: destroying it, or gloo's teardown, could hang
    except (ModelError, DataError, *user_error_types()) as e:  # one line, from rank 0 only
        if dist.get_rank() == 0:
            print(f"shardwise train: error: {one_line(e)}", file=sys.stderr)
        return 2
    finally:
        if made_group and dist.is_initialized():
            dist.destroy_process_group()


@dataclass
class Job:
    """What the steps need: the engine, data, outputs, and the counters of this launch."""

    args: Any
    engine: Any
    data: TokenData
    tokenizer: Any
    run_dir: Path
    tokens_per_step: int
    state: dict
    metrics: MetricsLog | None = None
    last_eval: tuple[int, float] | None = None
    times: dict = field(default_factory=lambda: {"data": 0.0, "step": 0.0, "n": 0})
    lock: RunLock | None = None  # rank 0's lock on run_dir, held until main() returns
    guard: NonFiniteGuard = field(default_factory=lambda: NonFiniteGuard(0))
    model: Any = None  # --pp: the model object the stages were cut from (config, generation config)

    @property
    def ckpt_dir(self) -> Path:
        return self.run_dir / "checkpoints"


def _setup(args, shardwise, held: list[RunLock]) -> Job:
    """Model, data and engine for ``args``; refuses to start fresh over an existing run's checkpoints.
    Rank 0's lock on the run folder is appended to ``held`` as soon as it is taken."""
    run_dir = Path(args.out)
    src = _check_before_writing(args)
    lock = _lock_run_folder(run_dir)
    held.extend([lock] if lock is not None else [])
    if args.resume == "none" and (run_dir / "checkpoints" / "latest").is_file():
        raise ConfigError(f"--out {run_dir} already holds checkpoints; pass --resume auto to continue it, or "
                          "choose another --out")
    if dist.get_rank() == 0:
        (run_dir / "run_config.json").write_text(json.dumps(resolved(args), indent=1) + "\n")
    tokenizer = load_tokenizer(src)
    data = TokenData.open(_prepare_data(args, tokenizer, run_dir), args.seq, args.eval_fraction, args.seed)
    stage = (args.ds_config.get("zero_optimization") or {}).get("stage", 0)
    if (args.ds_config.get("expert_parallel") or {}).get("enabled") or pipeline_job.stages_of(args.ds_config) > 1:
        stage = 0  # built whole (not under zero.Init): the experts are split before ZeRO shards the rest
    with pipeline_job.building(args.ds_config):  # --pp: only this rank's stage becomes real (in initialize)
        model = build_model(src, tokenizer.vocab_size, args.seq, args.seed, stage if isinstance(stage, int) else 0)
    size = n_params(model)
    if dist.get_rank() == 0:  # consolidate of a run stopped before its export still finds the tokenizer
        write_side_files(run_dir / RUN_TOKENIZER, tokenizer, model)
    engine, _, _, _ = shardwise.initialize(model=model, config=args.ds_config)
    if args.max_nonfinite_steps is not None:  # the flag wins over shardwise.max_nonfinite_steps
        engine.max_nonfinite_steps = args.max_nonfinite_steps
    cfg = engine.config
    global_batch = cfg.train_micro_batch_size_per_gpu * engine.gas * engine.dp_world
    pp = getattr(engine, "num_stages", 1)
    _log(f"{args.model} ({src.kind}): {size / 1e6:.2f}M params, tokenizer {tokenizer.name}; data "
         f"{len(data.tokens):,} tokens = {data.n_train} train + {data.n_eval} eval sequences of {args.seq}; "
         f"world {dist.get_world_size()} (pp {pp} x tp {engine.tp.size} x sp {cfg.sequence_parallel_size} x dp "
         f"{engine.dp_world}), ZeRO stage {engine.stage}, {cfg.precision}, {global_batch} sequences/step")
    if pp > 1:
        _log(pipeline_job.stage_note(engine, model))
    if args.config is None:
        _log(f"no --config: the defaults ({SUMMARY}); saved in {run_dir / 'run_config.json'}")
    note = passes_note(args.steps, global_batch, data.n_train)
    if note:
        _log(note)
    state = {"seq": args.seq, "seed": args.seed, "global_batch": global_batch}
    return Job(args, engine, data, tokenizer, run_dir, global_batch * args.seq, state, lock=lock,
               guard=NonFiniteGuard(engine.max_nonfinite_steps), model=pipeline_job.whole_model(engine, model))


def _check_before_writing(args: Any) -> ModelSource:
    """The model source, after refusing what the options alone show wrong, before --out is made.

    A typo in the config (found by the engine, after tokenizing) or a --data path that does not exist
    used to be refused only after the run folder held a lock, run_config.json and the tokenized data:
    a folder the next run would find, and half a minute spent first.
    """
    load_config(args.ds_config, world_size=dist.get_world_size(), supported=SupportedFeatures.everything())
    pipeline_job.check_layout(args.ds_config, dist.get_world_size())
    if dataset_kind(args.data) is None and not Path(args.data).exists():
        raise DataError(f"--data {args.data}: no such file or folder")
    return resolve_model(args.model)


def _lock_run_folder(run_dir: Path) -> RunLock | None:
    """Global rank 0 locks --out before anything is written; every rank gets its answer, so a
    refused run stops on all ranks before any of them writes (a shard, a token file)."""
    box: list = [None]
    lock = None
    if dist.get_rank() == 0:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            lock = RunLock(run_dir).acquire()
        except UserError as e:
            box[0] = str(e)
        except OSError as e:
            box[0] = f"--out {run_dir}: cannot create the folder ({e.strerror})"
    make_comm().broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise UserError(box[0])
    return lock


def _resume(job: Job) -> int:
    """Load the latest checkpoint of the run folder (``--resume auto``); returns the step to start at.

    A DeepSpeed or DCP checkpoint placed in ``RUN/checkpoints/`` (its ``latest`` and tag folder)
    continues at its own step counter (``global_steps``; DCP: Adam's step), as the docs promise.
    """
    if job.args.resume != "auto" or not (job.ckpt_dir / "latest").is_file():
        return 0
    path, client = job.engine.load_checkpoint(job.ckpt_dir)
    if path is not None and is_foreign(Path(path)):
        start = job.engine.global_steps
        _log(f"resumed from {path}, a checkpoint another library wrote, at its step {start} of {job.args.steps}; "
             "its data order was not this run's (from here batches follow --seed and the step)")
        return start
    start = client.get("step") if isinstance(client, dict) else None
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise UserError(f"--resume auto: {job.ckpt_dir} holds a checkpoint that is not a shardwise train run's "
                        "(its client_state has no step count); choose another --out or --resume none")
    skipped = client.get("nonfinite_steps", 0)  # absent in checkpoints of earlier versions
    if isinstance(skipped, int) and not isinstance(skipped, bool) and skipped >= 0:
        job.guard.count = job.engine.nonfinite_steps = skipped
    saved = (client.get("global_batch"), client.get("seq"))
    if saved != (job.state["global_batch"], job.state["seq"]):
        _log(f"warning: the checkpoint was written with {saved[0]} sequences of {saved[1]} per step, now "
             f"{job.state['global_batch']} of {job.state['seq']}: the data order differs from the first run's")
    _log(f"resumed from {job.ckpt_dir}/global_step{start} (step {start} of {job.args.steps})")
    return start


def _run(args, shardwise) -> int:
    held: list[RunLock] = []  # rank 0's lock, released on return or on a refusal after it was taken
    try:
        return _train(_setup(args, shardwise, held))
    finally:
        for lock in held:
            lock.release()


def _train(job: Job) -> int:
    """Resume, the steps, and the final outputs (or the stop after a signal) of a set-up job."""
    args = job.args
    stop = loop.StopRequest()
    start = _resume(job)
    if dist.get_rank() == 0:
        job.metrics = MetricsLog(job.run_dir, start)
    step, stopped = _steps(job, start, stop)
    if stopped:
        _log(f"stopped by signal at step {step}: checkpoint saved in {job.ckpt_dir}; continue with --resume auto")
        if job.metrics is not None:
            job.metrics.close()
        return 0
    if start >= args.steps:
        _log(f"{job.run_dir} is already at step {start} of --steps {args.steps}: only the final outputs are redone")
    return _finish(job, step)


def _steps(job: Job, start: int, stop: loop.StopRequest) -> tuple[int, bool]:
    """Train from ``start`` to --steps: metrics, evals, checkpoints; returns (last step, stopped)."""
    from tqdm import tqdm

    args, engine = job.args, job.engine
    # a bar on a terminal; elsewhere (a log file, a pipe) the engine's plain line every steps_per_print steps
    tty = sys.stderr.isatty()
    bar = tqdm(total=args.steps, initial=start, disable=dist.get_rank() != 0 or not tty, unit="step",
               dynamic_ncols=True)
    if tty:
        engine.monitor.printer = bar.write  # the engine's lines above the bar, not through it
    step, stopped = start, False
    try:  # closed before an error is printed, so the error is a line of its own
        while step < job.args.steps and not stopped:
            step, stopped = _one_step(job, step, stop, bar)
    finally:
        bar.close()
    return step, stopped


def _one_step(job: Job, step: int, stop: loop.StopRequest, bar) -> tuple[int, bool]:
    """Step ``step + 1``: train, log, stop on a non-finite value, eval and save when due."""
    args, engine = job.args, job.engine
    t0 = time.perf_counter()
    res = loop.train_step(engine, job.data, step, stop)
    step_s = time.perf_counter() - t0
    step, stopped = step + 1, res.stopped
    for k, v in (("data", res.data_s), ("step", step_s), ("n", 1)):
        job.times[k] += v
    bad = nonfinite_values(res.loss, res.grad_norm, res.loss_scaler_skipped)
    if job.metrics is not None:
        job.metrics.write({"kind": "train", "step": step, "loss": res.loss, "lr": engine.get_lr()[0],
                           "grad_norm": res.grad_norm, "tokens": step * job.tokens_per_step,
                           "tokens_per_s": job.tokens_per_step / step_s, "data_s": res.data_s, "step_s": step_s,
                           "memory": engine.memory_report(), "comm_bytes": engine.comm_stats(),
                           **({"nonfinite": bad} if bad else {})})
        bar.set_postfix(loss=f"{res.loss:.3f}", tok_s=f"{job.tokens_per_step / step_s:,.0f}")
        bar.update(1)
    if bad:  # counted; past the allowance every rank stops here, nothing of this step saved
        job.guard.after_step(step, bad, _latest(job))
    elif not res.loss_scaler_skipped:
        dead = job.guard.dead_model_note(step, res.grad_norm)
        if dead:
            _log(dead)
    saving = stopped or step == args.steps or (args.save_every and step % args.save_every == 0)
    if saving:  # the weights first: an overflowed weight is named as such, not as the NaN loss it causes
        job.guard.check_weights(engine, step, "the checkpoint")
    due = bool(args.eval_every) and step % args.eval_every == 0  # also when stopping: the resumed run
    if job.data.n_eval and (due or step == args.steps):  # starts after this step and would never redo it;
        _eval(job, step, bar)  # the last step's final eval comes before its save (a NaN one saves nothing)
    if saving:
        job.guard.check_probe(step, loop.probe_loss(engine, job.data), "the checkpoint")
        loop.save(engine, job.ckpt_dir, step, {**job.state, "step": step, "nonfinite_steps": job.guard.count},
                  args.keep, wait=stopped or step == args.steps)  # the last save and a stop's: published now
    return step, stopped


def _check_state(job: Job, step: int, before: str) -> None:
    """Weights finite, and what they compute: checked on every rank before a checkpoint or the export."""
    job.guard.check_weights(job.engine, step, before)
    job.guard.check_probe(step, loop.probe_loss(job.engine, job.data), before)


def _latest(job: Job) -> str | None:
    """The checkpoint ``latest`` names (for the divergence message), or None; collective: a save still
    being written is published first (the run stops next, and its message names that checkpoint)."""
    wait_for_checkpoint()
    f = job.ckpt_dir / "latest"
    return str(job.ckpt_dir / f.read_text().strip()) if f.is_file() else None


def _eval(job: Job, step: int, bar=None) -> None:
    loss = loop.evaluate(job.engine, job.data)
    job.last_eval = (step, loss)
    if job.metrics is not None:
        job.metrics.write({"kind": "eval", "step": step, "tokens": step * job.tokens_per_step, "eval_loss": loss,
                           "eval_ppl": perplexity(loss)})
        msg = f"[shardwise train] step {step}: eval loss {loss:.4f}, perplexity {perplexity(loss):.2f}"
        if bar is not None:
            bar.write(msg)
        else:
            print(msg, flush=True)
    job.guard.check_eval(step, loss, None if math.isfinite(loss) else _latest(job))  # every rank alike: all-reduced


def _finish(job: Job, step: int) -> int:
    """Final eval (unless this step was just evaluated), sample, hf/ export, plot, summary."""
    args, engine = job.args, job.engine
    if job.data.n_eval and (job.last_eval is None or job.last_eval[0] != step):
        _eval(job, step)
    staged = pipeline_job.staged(engine, job.model) if job.model is not None else None  # --pp: through the stages
    if not args.no_export:  # before the sample: nothing after a finished run may lose the export
        _check_state(job, step, "the hf/ export")
        pipeline_job.save_hf(engine, job.model, job.run_dir / "hf")
        if dist.get_rank() == 0:  # with its tokenizer and generation config: `shardwise generate` runs on it
            write_side_files(job.run_dir / "hf", job.tokenizer, job.model if staged else engine.module)
        _log(f"model exported to {job.run_dir / 'hf'} (try: shardwise generate --model {job.run_dir / 'hf'} "
             f"--prompt ...)")
    if args.sample_tokens:
        try:
            _sample(job, step, staged or engine)
        except DivergedError:  # the model that was exported computes non-finite logits: no export of it
            if dist.get_rank() == 0 and not args.no_export:
                shutil.rmtree(job.run_dir / "hf", ignore_errors=True)
            raise
    reports: list = [None] * dist.get_world_size()
    make_comm().all_gather_object(reports, engine.memory_report())
    if dist.get_rank() == 0:
        job.metrics.close()
        plot = plot_loss(job.run_dir)
        t = job.times
        if t["n"]:
            _log(f"{t['n']} steps: {t['n'] * job.tokens_per_step / t['step']:,.0f} tokens/s; data loading "
                 f"{1e3 * t['data'] / t['n']:.2f} ms of {1e3 * t['step'] / t['n']:.1f} ms per step "
                 f"({100 * t['data'] / t['step']:.2f}%)")
        if job.last_eval is not None:
            _log(f"final eval loss {job.last_eval[1]:.4f}, perplexity {perplexity(job.last_eval[1]):.2f}")
            note = eval_rise_note([r for r in read_metrics(job.run_dir) if r["kind"] == "eval"])
            if note:
                _log(note)
        if plot is not None:
            _log(f"loss plot: {plot}")
        print("model-state memory per rank (tensor bytes):\n" + memory_table(reports))
        print(f"communication per rank: {human_counts(engine.comm_stats())} (bytes in metrics.jsonl)", flush=True)
    return 0


def _sample(job: Job, step: int, model: Any) -> None:
    """Generate from --prompt (default: the start of the held-out text), within the model's positions."""
    args, data = job.args, job.data
    prompt = job.tokenizer.encode(args.prompt) if args.prompt else []
    if not prompt:  # no --prompt, or one with no tokens: the start of the held-out text
        prompt = data.sequence(data.n_train if data.n_eval else 0)[:min(32, args.seq // 2)].tolist()
    room = getattr(model.module.config, "max_position_embeddings", None)
    if room is not None:  # keep the prompt's end, leaving room for at least one new token
        prompt = prompt[-(room - 1):]
    new_tokens = args.sample_tokens if room is None else max(1, min(args.sample_tokens, room - len(prompt)))
    text = loop.sample(model, job.tokenizer, prompt, new_tokens, args.seed, FiniteLogits(step))
    if dist.get_rank() == 0:
        (job.run_dir / "sample.txt").write_text(text + "\n")
        print(f"[shardwise train] sample ({new_tokens} tokens after a {len(prompt)}-token prompt):\n{text}\n",
              flush=True)
