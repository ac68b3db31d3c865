"""``shardwise generate``: stream text from an HF model folder, its layers streamed if asked.

Tokens are printed as they come (HF ``TextStreamer``, rank 0 only); at the end one line gives
tokens/s and peak memory. With ``--nproc N`` the command relaunches itself on N ranks through
``shardwise launch`` (stage-3 inference: each rank holds 1/N of every layer; or ``--tp``).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

from shardwise.cli.parsers import DTYPES, generate_parser
from shardwise.errors import UserError
from shardwise.files.model_folder import check_model_folder, loading


def parse(argv: list[str]) -> argparse.Namespace:
    p = generate_parser()
    args = p.parse_args(argv)
    if args.temperature == 0:  # documented: greedy (sampling's limit), not a division by zero
        args.temperature = None
        if args.top_p is not None:
            p.error("--top-p has no effect with --temperature 0 (greedy decoding); drop one of them")
    if not args.prompt:
        p.error("--prompt is empty; give at least one character of text to continue")
    if not (Path(args.model) / "config.json").is_file():
        if (Path(args.model) / "hf" / "config.json").is_file():  # a `shardwise train` run folder
            p.error(f"--model {args.model!r} is a run folder; its exported model is --model "
                    f"{Path(args.model) / 'hf'}")
        p.error(f"--model {args.model!r}: no config.json there; pass a folder written by save_pretrained "
                "or `shardwise consolidate` (Hub names are not downloaded)")
    names = os.listdir(args.model) if os.access(args.model, os.R_OK | os.X_OK) else ["tokenizer?"]  # unreadable: later
    if not any(n.startswith(("tokenizer", "vocab")) or n.endswith(".model") for n in names):
        p.error(f"--model {args.model}: no tokenizer files there (tokenizer.json, tokenizer_config.json, ...); copy "
                "the tokenizer the model was trained with into the folder (`shardwise train` exports and "
                "`shardwise consolidate` of a train run carry theirs)")
    if args.top_p is not None and args.temperature is None:
        p.error("--top-p needs --temperature (sampling); greedy decoding ignores it")
    if args.backend != "auto" and args.nproc == 1 and "RANK" not in os.environ:
        p.error(f"--backend {args.backend} picks the ranks' backend: add --nproc N (N >= 2)")
    if args.tp > max(args.nproc, int(os.environ.get("WORLD_SIZE", "1"))):
        p.error(f"--tp {args.tp} needs at least as many ranks: add --nproc {args.tp}")
    return args


def check_prompt_room(prompt_tokens: int, new_tokens: int | None, config) -> int:
    """The tokens to generate: ``new_tokens``, or by default 64 (fewer if the positions run out).

    Refused: an empty prompt, or one that with the tokens asked for passes the model's positions
    (a model with learned positions fails inside its embedding otherwise)."""
    if prompt_tokens == 0:
        raise UserError("--prompt tokenizes to no tokens; give some text to continue")
    room = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if new_tokens is None:
        new_tokens = 64 if not isinstance(room, int) else max(1, min(64, room - prompt_tokens))
    if isinstance(room, int) and prompt_tokens + new_tokens > room:
        raise UserError(f"--prompt is {prompt_tokens} tokens and --max-new-tokens {new_tokens}, more than the "
                        f"model's {room} positions; shorten the prompt or pass --max-new-tokens "
                        f"{max(room - prompt_tokens, 0)} or less")
    return new_tokens


def _peak_memory() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.max_memory_allocated() / 2**20:.1f} MiB on the GPU"
    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.1f} MiB RSS"


def _progress(rank: int):
    """A one-line loading progress on stderr (rank 0, rewritten in place)."""
    def show(done: int, total: int) -> None:
        if rank == 0:
            end = "\n" if done == total else ""
            print(f"\r[shardwise generate] loading: {done}/{total} units", end=end, file=sys.stderr, flush=True)
    return show


def _report(model, new: int, seconds: float, batch: int) -> str:
    """tokens/s, bytes read per generated token (streamed from disk), peak memory, whole layers."""
    from shardwise.inference.stream import stream_state_of  # torch loads only once a rank runs

    state = stream_state_of(model)
    fetcher, files = (state.fetcher, state.files) if state is not None else (None, None)
    line = f"{new} tokens in {seconds:.2f} s: {batch * new / seconds:.2f} tokens/s"
    if files is not None and new and files.bytes_read:  # offload="cpu" reads memory, not files
        line += f"; {files.bytes_read / new / 2**20:.1f} MiB read per token"
    import torch

    threads = torch.get_num_threads()
    line += f"; {threads} compute thread{'s' if threads > 1 else ''}; peak memory {_peak_memory()}"
    if fetcher is not None:
        line += f", whole layers at most {fetcher.peak_gathered_bytes / 2**20:.1f} MiB"
    return line


def _generate(model, ids, gen: dict, streamer, threads: int | None, report: bool) -> None:
    """Generate (tokens go to ``streamer``) on ``threads`` compute threads if given, then the report line.

    The thread count is torch's process-wide setting: it is restored afterwards, so an in-process
    caller keeps its own."""
    import torch

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, streamer=streamer, **gen)
        seconds = time.perf_counter() - start
        if report:
            print(f"\n[shardwise generate] {_report(model, out.shape[-1] - ids.shape[-1], seconds, ids.shape[0])}",
                  flush=True)
    finally:
        torch.set_num_threads(before)


def _rss_now() -> dict[str, int] | None:
    """VmRSS and RssFile (bytes) from /proc, None where there is no /proc (then no peak is printed)."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "RssFile", "VmHWM")}
    except (OSError, KeyError, ValueError):
        return None


def _baseline() -> dict[str, int] | None:
    """The RSS now, with the kernel's peak (VmHWM) reset to it so the peak read later is this run's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _rss_now()


def _peak_growth(baseline: dict[str, int] | None) -> int | None:
    """The peak's growth over ``baseline`` less file-backed growth (library code paged in): the
    anonymous memory the bound is about. An upper bound if the load peaked higher than generation."""
    now = _rss_now()
    if baseline is None or now is None:
        return None
    return now["VmHWM"] - baseline["VmRSS"] - max(now["RssFile"] - baseline["RssFile"], 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if args.nproc > 1 and "RANK" not in os.environ:  # not a rank yet: start the ranks
        from shardwise.cli.command import launch

        rest = [a for i, a in enumerate(argv)  # the ranks must not see --nproc (nor torchrun)
                if not a.startswith("--nproc") and not (i > 0 and argv[i - 1] == "--nproc")]
        return launch(["--nproc", str(args.nproc), "--backend", args.backend, "--", "generate", *rest])

    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer, TextStreamer

    from shardwise.comm import make_comm
    owned = not dist.is_initialized()  # a caller's process group is left to the caller

    from shardwise.inference.load import init_inference
    from shardwise.inference.stream import stream_state_of

    rank = int(os.environ.get("RANK", "0"))
    check_model_folder(args.model)
    with loading(args.model, "tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    if args.quantize and not args.offload:
        print("shardwise generate: --quantize streams quantized layers: add --offload disk or cpu", file=sys.stderr)
        return 2
    kwargs = dict(quantize=args.quantize, group_size=args.group_size) if args.quantize else {}
    if args.tp == 1:
        kwargs["progress"] = _progress(rank)
    baseline = _baseline() if args.verbose else None
    model = init_inference(args.model, tensor_parallel_size=args.tp, offload=args.offload, dtype=dtype,
                           prefetch=args.prefetch, **kwargs)
    device = next(model.buffers(), next(model.parameters())).device
    with loading(args.model, "tokenizer"):
        ids = tokenizer(args.prompt, return_tensors="pt").input_ids.to(device)
    new_tokens = check_prompt_room(ids.shape[-1], args.max_new_tokens, getattr(model, "config", None))
    gen = dict(max_new_tokens=new_tokens, do_sample=args.temperature is not None)
    if args.temperature is not None:
        gen.update(temperature=args.temperature, top_p=args.top_p if args.top_p is not None else 1.0)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is not None:
        gen["pad_token_id"] = pad
    torch.manual_seed(args.seed)  # every rank draws the same tokens
    streamer = TextStreamer(tokenizer) if rank == 0 else None
    state = stream_state_of(model)
    files = state.files if state is not None else None
    if files is not None:
        files.bytes_read = 0  # count what generation reads, not the load
    _generate(model, ids, gen, streamer, args.threads, report=rank == 0)
    if args.verbose and rank == 0 and state is not None:
        from shardwise.inference.bound import format_bound, memory_bound

        terms = memory_bound(model, ids.shape[0], ids.shape[-1], new_tokens)
        print(f"[shardwise generate] {format_bound(terms, _peak_growth(baseline))}", flush=True)
    if owned and dist.is_initialized():  # a gloo group left to the interpreter's exit may abort the rank
        make_comm("world").barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
