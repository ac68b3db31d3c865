"""`shardwise train`: the main job, from options to the exported model.

Order of work: options -> model source and tokenizer -> token file (rank 0 writes, all map it) ->
model (under zero.Init at stage 3) -> engine -> resume -> steps (metrics, eval, checkpoints, stop on
SIGTERM/SIGINT) -> final eval, sample, hf/ export, loss.png, memory table.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch.distributed as dist

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

    shardwise.init_distributed()
    try:
        return _run(args, shardwise)
    except (ModelError, DataError, ConfigError) as e:
        if dist.get_rank() == 0:
            print(f"shardwise train: error: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(args, shardwise) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    run_dir, stop = Path(args.out), loop.StopRequest()
    ckpt_dir = run_dir / "checkpoints"
    resuming = args.resume == "auto" and (ckpt_dir / "latest").is_file()
    if args.resume == "none" and (ckpt_dir / "latest").is_file():
        raise ConfigError(f"--out {run_dir} already holds checkpoints; pass --resume auto to continue it, or "
                          "choose another --out")
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "run_config.json").write_text(json.dumps(resolved(args), indent=1) + "\n")
    src = resolve_model(args.model)
    tokenizer = load_tokenizer(src)
    data = TokenData.open(_prepare_data(args, tokenizer, run_dir), args.seq, args.eval_fraction, args.seed)
    stage = (args.ds_config.get("zero_optimization") or {}).get("stage", 0)
    model = build_model(src, tokenizer.vocab_size, args.seq, args.seed, stage if isinstance(stage, int) else 0)
    size = n_params(model)
    engine, _, _, _ = shardwise.initialize(model=model, config=args.ds_config)
    cfg = engine.config
    global_batch = cfg.train_micro_batch_size_per_gpu * engine.gas * engine.dp_world
    tokens_per_step = global_batch * args.seq
    _log(f"{args.model} ({src.kind}): {size / 1e6:.2f}M params, tokenizer {tokenizer.name}; data "
         f"{len(data.tokens):,} tokens = {data.n_train} train + {data.n_eval} eval sequences of {args.seq}; "
         f"world {world} (tp {engine.tp.size} x dp {engine.dp_world}), ZeRO stage {engine.stage}, "
         f"{cfg.precision}, {global_batch} sequences/step")
    start = 0
    if resuming:
        _, client = engine.load_checkpoint(ckpt_dir)
        start = int(client["step"])
        if client.get("global_batch") != global_batch or client.get("seq") != args.seq:
            _log(f"warning: the checkpoint was written with {client.get('global_batch')} sequences of "
                 f"{client.get('seq')} per step, now {global_batch} of {args.seq}: the data order differs")
        _log(f"resumed from {ckpt_dir}/global_step{start} (step {start} of {args.steps})")
    metrics = MetricsLog(run_dir, start if resuming else None) if rank == 0 else None
    state = {"seq": args.seq, "seed": args.seed, "global_batch": global_batch}
    last_eval, stopped, times = None, False, {"data": 0.0, "step": 0.0, "n": 0}
    from tqdm import tqdm

    bar = tqdm(total=args.steps, initial=start, disable=rank != 0, unit="step", dynamic_ncols=True)
    step = start
    while step < args.steps:
        t0 = time.perf_counter()
        loss, stopped, data_s = loop.train_step(engine, data, step, stop)
        step_s = time.perf_counter() - t0
        step += 1
        times["data"] += data_s
        times["step"] += step_s
        times["n"] += 1
        if metrics is not None:
            metrics.write({"kind": "train", "step": step, "loss": loss, "lr": engine.get_lr()[0],
                           "grad_norm": engine.get_global_grad_norm(), "tokens": step * tokens_per_step,
                           "tokens_per_s": tokens_per_step / step_s, "data_s": data_s, "step_s": step_s,
                           "memory": engine.memory_report(), "comm_bytes": engine.comm_stats()})
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_step / step_s:,.0f}")
            bar.update(1)
        if data.n_eval and args.eval_every and step % args.eval_every == 0 and not stopped:
            last_eval = _eval(engine, data, step, tokens_per_step, metrics, bar)
        if stopped or step == args.steps or (args.save_every and step % args.save_every == 0):
            loop.save(engine, ckpt_dir, step, {**state, "step": step}, args.keep)
        if stopped:
            break
    bar.close()
    if stopped:
        _log(f"stopped by signal at step {step}: checkpoint saved in {ckpt_dir}; continue with --resume auto")
        if metrics is not None:
            metrics.close()
        return 0
    if start >= args.steps:
        _log(f"{run_dir} is already at step {start} of --steps {args.steps}: only the final outputs are redone")
    return _finish(args, engine, data, tokenizer, run_dir, step, tokens_per_step, metrics, last_eval, times)


def _eval(engine, data, step, tokens_per_step, metrics, bar=None) -> tuple[int, float]:
    loss = loop.evaluate(engine, data)
    if metrics is not None:
        metrics.write({"kind": "eval", "step": step, "tokens": step * tokens_per_step, "eval_loss": loss,
                       "eval_ppl": perplexity(loss)})
        msg = f"step {step}: eval loss {loss:.4f}, perplexity {perplexity(loss):.2f}"
        (bar.write if bar is not None else print)(f"[shardwise train] {msg}")
    return step, loss


def _finish(args, engine, data, tokenizer, run_dir, step, tokens_per_step, metrics, last_eval, times) -> int:
    """Final eval (unless this step was just evaluated), sample, hf/ export, plot, summary."""
    if data.n_eval and (last_eval is None or last_eval[0] != step):
        last_eval = _eval(engine, data, step, tokens_per_step, metrics)
    if args.sample_tokens:
        if args.prompt is not None:
            prompt = tokenizer.encode(args.prompt)
        else:
            first = data.n_train if data.n_eval else 0
            prompt = data.sequence(first)[:min(32, args.seq // 2)].tolist()
        text = loop.sample(engine, tokenizer, prompt, args.sample_tokens, args.seed)
        if dist.get_rank() == 0:
            (run_dir / "sample.txt").write_text(text + "\n")
            print(f"[shardwise train] sample ({args.sample_tokens} tokens after a {len(prompt)}-token prompt):\n"
                  f"{text}\n", flush=True)
    if not args.no_export:
        engine.save_16bit_model(run_dir / "hf")
        if dist.get_rank() == 0 and hasattr(tokenizer, "tok"):
            tokenizer.tok.save_pretrained(str(run_dir / "hf"))
        _log(f"model exported to {run_dir / 'hf'} (transformers from_pretrained loads it)")
    reports: list = [None] * dist.get_world_size()
    dist.all_gather_object(reports, engine.memory_report())
    if dist.get_rank() == 0:
        metrics.close()
        plot = plot_loss(run_dir)
        if times["n"]:
            print(f"[shardwise train] {times['n']} steps: {times['n'] * tokens_per_step / times['step']:,.0f} "
                  f"tokens/s; data loading {1e3 * times['data'] / times['n']:.2f} ms of "
                  f"{1e3 * times['step'] / times['n']:.1f} ms per step "
                  f"({100 * times['data'] / times['step']:.2f}%)")
        if last_eval is not None:
            print(f"[shardwise train] final eval loss {last_eval[1]:.4f}, perplexity {perplexity(last_eval[1]):.2f}")
        if plot is not None:
            print(f"[shardwise train] loss plot: {plot}")
        print("model-state memory per rank (tensor bytes):\n" + memory_table(reports))
        print("communication per rank (bytes):", json.dumps(engine.comm_stats()), flush=True)
    return 0
