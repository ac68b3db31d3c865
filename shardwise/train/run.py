"""`shardwise train`: the main job, from options to the exported model.

Order of work: options -> model source and tokenizer -> token file (rank 0 writes, all map it) ->
model (under zero.Init at stage 3) -> engine -> resume -> steps (metrics, eval, checkpoints, stop on
SIGTERM/SIGINT) -> final eval, sample, hf/ export, loss.png, memory table.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from shardwise.cli_errors import UserError, one_line, user_error_types
from shardwise.config import ConfigError
from shardwise.train import loop
from shardwise.train.data import DataError, TokenData, list_sources, tokenize_to_cache
from shardwise.train.model import ModelError, build_model, load_tokenizer, n_params, resolve_model
from shardwise.train.options import parse_args, resolved
from shardwise.train.outputs import MetricsLog, memory_table, perplexity, plot_loss


def _prepare_data(args, tokenizer, run_dir: Path) -> Path:
    """Global rank 0 tokenizes (or finds the cache); every rank gets the path or rank 0's error."""
    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = str(tokenize_to_cache(list_sources(args.data), tokenizer, run_dir / "data", args.text_key))
        except DataError as e:
            box[0] = DataError(str(e))
        except Exception as e:  # noqa: BLE001 - the other ranks wait in the broadcast: send it to them
            box[0] = DataError(f"--data {args.data}: tokenizing failed: {type(e).__name__}: {e}")
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    return Path(box[0])


def _log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(f"[shardwise train] {msg}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import shardwise

    shardwise.init_distributed(timeout=args.timeout)
    try:
        return _run(args, shardwise)
    except (ModelError, DataError, *user_error_types()) as e:  # one line, from rank 0 only
        if dist.get_rank() == 0:
            print(f"shardwise train: error: {one_line(e)}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
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

    @property
    def ckpt_dir(self) -> Path:
        return self.run_dir / "checkpoints"


def _setup(args, shardwise) -> Job:
    """Model, data and engine for ``args``; refuses to start fresh over an existing run's checkpoints."""
    run_dir = Path(args.out)
    if args.resume == "none" and (run_dir / "checkpoints" / "latest").is_file():
        raise ConfigError(f"--out {run_dir} already holds checkpoints; pass --resume auto to continue it, or "
                          "choose another --out")
    if dist.get_rank() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "run_config.json").write_text(json.dumps(resolved(args), indent=1) + "\n")
    src = resolve_model(args.model)
    tokenizer = load_tokenizer(src)
    data = TokenData.open(_prepare_data(args, tokenizer, run_dir), args.seq, args.eval_fraction, args.seed)
    stage = (args.ds_config.get("zero_optimization") or {}).get("stage", 0)
    if (args.ds_config.get("expert_parallel") or {}).get("enabled"):
        stage = 0  # built whole (not under zero.Init): the experts are split before ZeRO shards the rest
    model = build_model(src, tokenizer.vocab_size, args.seq, args.seed, stage if isinstance(stage, int) else 0)
    size = n_params(model)
    engine, _, _, _ = shardwise.initialize(model=model, config=args.ds_config)
    cfg = engine.config
    global_batch = cfg.train_micro_batch_size_per_gpu * engine.gas * engine.dp_world
    _log(f"{args.model} ({src.kind}): {size / 1e6:.2f}M params, tokenizer {tokenizer.name}; data "
         f"{len(data.tokens):,} tokens = {data.n_train} train + {data.n_eval} eval sequences of {args.seq}; "
         f"world {dist.get_world_size()} (tp {engine.tp.size} x dp {engine.dp_world}), ZeRO stage "
         f"{engine.stage}, {cfg.precision}, {global_batch} sequences/step")
    state = {"seq": args.seq, "seed": args.seed, "global_batch": global_batch}
    return Job(args, engine, data, tokenizer, run_dir, global_batch * args.seq, state)


def _resume(job: Job) -> int:
    """Load the latest checkpoint of the run folder (``--resume auto``); returns the step to start at."""
    if job.args.resume != "auto" or not (job.ckpt_dir / "latest").is_file():
        return 0
    _, client = job.engine.load_checkpoint(job.ckpt_dir)
    start = client.get("step") if isinstance(client, dict) else None
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise UserError(f"--resume auto: {job.ckpt_dir} holds a checkpoint that is not a shardwise train run's "
                        "(its client_state has no step count); choose another --out or --resume none")
    saved = (client.get("global_batch"), client.get("seq"))
    if saved != (job.state["global_batch"], job.state["seq"]):
        _log(f"warning: the checkpoint was written with {saved[0]} sequences of {saved[1]} per step, now "
             f"{job.state['global_batch']} of {job.state['seq']}: the data order differs from the first run's")
    _log(f"resumed from {job.ckpt_dir}/global_step{start} (step {start} of {job.args.steps})")
    return start


def _run(args, shardwise) -> int:
    job = _setup(args, shardwise)
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
    bar = tqdm(total=args.steps, initial=start, disable=dist.get_rank() != 0, unit="step", dynamic_ncols=True)
    step, stopped = start, False
    while step < args.steps and not stopped:
        t0 = time.perf_counter()
        loss, stopped, data_s = loop.train_step(engine, job.data, step, stop)
        step_s = time.perf_counter() - t0
        step += 1
        for k, v in (("data", data_s), ("step", step_s), ("n", 1)):
            job.times[k] += v
        if job.metrics is not None:
            job.metrics.write({"kind": "train", "step": step, "loss": loss, "lr": engine.get_lr()[0],
                               "grad_norm": engine.get_global_grad_norm(), "tokens": step * job.tokens_per_step,
                               "tokens_per_s": job.tokens_per_step / step_s, "data_s": data_s, "step_s": step_s,
                               "memory": engine.memory_report(), "comm_bytes": engine.comm_stats()})
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{job.tokens_per_step / step_s:,.0f}")
            bar.update(1)
        if job.data.n_eval and args.eval_every and step % args.eval_every == 0:  # also when stopping:
            _eval(job, step, bar)  # the resumed run starts after this step, so it would never redo it
        if stopped or step == args.steps or (args.save_every and step % args.save_every == 0):
            loop.save(engine, job.ckpt_dir, step, {**job.state, "step": step}, args.keep)
    bar.close()
    return step, stopped


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


def _finish(job: Job, step: int) -> int:
    """Final eval (unless this step was just evaluated), sample, hf/ export, plot, summary."""
    args, engine = job.args, job.engine
    if job.data.n_eval and (job.last_eval is None or job.last_eval[0] != step):
        _eval(job, step)
    if not args.no_export:  # before the sample: nothing after a finished run may lose the export
        engine.save_16bit_model(job.run_dir / "hf")
        if dist.get_rank() == 0 and hasattr(job.tokenizer, "tok"):
            job.tokenizer.tok.save_pretrained(str(job.run_dir / "hf"))
        _log(f"model exported to {job.run_dir / 'hf'} (transformers from_pretrained loads it)")
    if args.sample_tokens:
        _sample(job)
    reports: list = [None] * dist.get_world_size()
    dist.all_gather_object(reports, engine.memory_report())
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
        if plot is not None:
            _log(f"loss plot: {plot}")
        print("model-state memory per rank (tensor bytes):\n" + memory_table(reports))
        print("communication per rank (bytes):", json.dumps(engine.comm_stats()), flush=True)
    return 0


def _sample(job: Job) -> None:
    """Generate from --prompt (default: the start of the held-out text), within the model's positions."""
    args, data = job.args, job.data
    prompt = job.tokenizer.encode(args.prompt) if args.prompt else []
    if not prompt:  # no --prompt, or one with no tokens: the start of the held-out text
        prompt = data.sequence(data.n_train if data.n_eval else 0)[:min(32, args.seq // 2)].tolist()
    room = getattr(job.engine.module.config, "max_position_embeddings", None)
    if room is not None:  # keep the prompt's end, leaving room for at least one new token
        prompt = prompt[-(room - 1):]
    new_tokens = args.sample_tokens if room is None else max(1, min(args.sample_tokens, room - len(prompt)))
    text = loop.sample(job.engine, job.tokenizer, prompt, new_tokens, args.seed)
    if dist.get_rank() == 0:
        (job.run_dir / "sample.txt").write_text(text + "\n")
        print(f"[shardwise train] sample ({new_tokens} tokens after a {len(prompt)}-token prompt):\n{text}\n",
              flush=True)
