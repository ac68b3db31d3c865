"""The argument parsers of ``consolidate``, ``quantize`` and ``generate``, free of torch.

Their commands build them (``cli.consolidate.main``, ``cli.quantize.main``,
``cli.generate.parse``) and so does ``cli.command`` to answer ``--help`` before any heavy import.
"""

from __future__ import annotations

import argparse

from shardwise.errors import OneLineParser, bounded_int, finite_float
from shardwise.launch.devices import BACKENDS

GENERATE_EXAMPLES = """examples:
  shardwise generate --model runs/sonnets/hf --prompt "Shall I compare thee" --max-new-tokens 64
  shardwise generate --model big_dir --prompt "Hello" --offload disk          (weights stay on disk)
  shardwise generate --model big_dir --prompt "Hello" --offload cpu --dtype bf16
  shardwise quantize big_dir big_int4 --bits 4 && \\
  shardwise generate --model big_int4 --prompt "Hello" --offload disk        (4-bit weights: fewer bytes)
  shardwise generate --model big_dir --prompt "Hello" --offload cpu --quantize int8   (quantized at load)
  shardwise generate --model big_int4 --prompt "Hello" --offload disk --prefetch 4 --threads 1   (2 cores)
  shardwise generate --model dir --prompt "Hello" --nproc 2                  (each rank holds 1/2)
  shardwise generate --model dir --prompt "Hello" --tp 2 --nproc 2           (tensor parallel)
  shardwise generate --model dir --prompt "Hello" --nproc 2 --backend gloo   (2 CPU ranks on a 1-GPU machine)
  shardwise generate --model dir --prompt "Hi" --temperature 0.8 --top-p 0.95 --seed 1
"""

DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
          "fp16": "float16", "float16": "float16"}
DEFAULT_GROUP = 64  # elements per quantization scale (shardwise.inference.quant_format.DEFAULT_GROUP)


def generate_parser() -> OneLineParser:
    p = OneLineParser(prog="shardwise generate", epilog=GENERATE_EXAMPLES,
                      formatter_class=argparse.RawDescriptionHelpFormatter,
                      description="Generate text from a save_pretrained folder (safetensors and "
                                  "its tokenizer), streaming tokens to stdout.")
    p.add_argument("--model", required=True, help="folder with config, safetensors weights and tokenizer")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=bounded_int(1, 10**6, "--max-new-tokens"), default=None,
                   help="tokens to generate (default 64, fewer when the model's positions run out first)")
    p.add_argument("--offload", choices=["disk", "cpu"], default=None,
                   help="stream decoder layers from disk (nothing resident) or from CPU memory")
    p.add_argument("--prefetch", type=bounded_int(0, 1024, "--prefetch"), default=1,
                   help="layers read ahead of the running one (default 1)")
    p.add_argument("--threads", type=bounded_int(1, 4096, "--threads"), default=None,
                   help="torch compute threads (default: torch's). Streaming from disk on a CPU, one fewer "
                        "than the cores leaves the reader thread a core of its own (see docs/inference.md)")
    p.add_argument("--quantize", choices=["int8", "int4"], default=None,
                   help="stream group-wise quantized layers (with --offload; from disk: a `shardwise quantize` copy)")
    p.add_argument("--group-size", type=bounded_int(1, 1 << 20, "--group-size"), default=None,
                   help=f"elements per scale with --quantize (default {DEFAULT_GROUP})")
    p.add_argument("--tp", type=bounded_int(1, 4096, "--tp"), default=1, help="tensor parallel size")
    p.add_argument("--nproc", type=bounded_int(1, 4096, "--nproc"), default=1,
                   help="ranks to run on (relaunches via `shardwise launch`)")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="with --nproc, as `shardwise launch --backend`: auto (NCCL where torch sees GPUs, else "
                        "gloo); gloo: CPU ranks, the GPUs hidden from them")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="compute dtype (default: the model's)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--greedy", action="store_true", help="greedy decoding (the default)")
    mode.add_argument("--temperature", type=finite_float(0, 100, "--temperature"), default=None,
                      help="sample at this temperature (0: greedy decoding, the limit of sampling as it goes to 0)")
    p.add_argument("--top-p", type=finite_float(0, 1, "--top-p", low_open=True), default=None,
                   help="nucleus sampling in (0, 1] (with --temperature)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed, the same on every rank")
    p.add_argument("--verbose", action="store_true",
                   help="with --offload or --nproc: print the memory bound term by term (docs/inference.md) "
                        "next to the measured peak")
    return p


def consolidate_parser() -> OneLineParser:
    p = OneLineParser(
        prog="shardwise consolidate",
        description="Write a Hugging Face model folder (config.json, model*.safetensors, and the tokenizer and "
                    "generation config when the run saved them) from a shardwise checkpoint saved at any world "
                    "size, ZeRO stage and TP degree, one tensor at a time.",
        epilog="examples:\n  shardwise consolidate runs/sonnets hf_out/          (a `shardwise train` run folder)\n"
               "  shardwise consolidate ckpts/ hf_out/\n"
               "  shardwise consolidate ckpts/ hf_out/ --tag global_step1000 --dtype bf16 "
               "--max-shard-size 2GB",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ckpt_dir", help="folder given to save_checkpoint (holding 'latest' and tag folders), or a "
                                    "`shardwise train` run folder")
    p.add_argument("out_dir", help="output folder for the HF model")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: the one named in 'latest')")
    p.add_argument("--dtype", default="fp32", help="fp32 (default: the exact fp32 master), bf16 or fp16")
    p.add_argument("--max-shard-size", default="5GB", help="largest weight file, e.g. 5GB, 500MB")
    p.add_argument("--no-verify", action="store_true", help="skip sha256 checks (sizes still checked)")
    p.add_argument("--config", default=None, help="HF config.json to write (default: the checkpoint's)")
    p.add_argument("--weights-only", action="store_true",
                   help="allow a checkpoint without config.json: write the weight files alone")
    p.add_argument("--overwrite", action="store_true",
                   help="OUT may hold other files: replace only the HF weight files and config.json there")
    return p


def quantize_parser(kernel_rows: int | None = None) -> OneLineParser:
    """``kernel_rows``: this machine's int4 kernel order, shown as the default (None: not asked,
    as for ``--help``, which must not import torch to find it)."""
    p = OneLineParser(prog="shardwise quantize", formatter_class=argparse.RawDescriptionHelpFormatter,
                      description="Write a group-wise int8/int4 copy of a save_pretrained folder for "
                                  "streamed inference (init_inference / generate --offload); the tokenizer "
                                  "and generation config are copied with it.",
                      epilog="examples:\n  shardwise quantize llama_dir llama_int4 --bits 4\n"
                             "  shardwise generate --model llama_int4 --prompt Hi --offload disk")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--bits", type=int, choices=[8, 4], required=True)
    p.add_argument("--group-size", type=bounded_int(1, 1 << 20, "--group-size"), default=DEFAULT_GROUP,
                   help=f"elements per scale (default {DEFAULT_GROUP})")
    here = "this machine's" if kernel_rows is None else f"this machine's, {kernel_rows}"
    p.add_argument("--kernel-order", type=int, choices=[64, 32], default=None,
                   help="int4: rows per block of the CPU kernel's byte order to write (64: AVX-512 machines, "
                        f"32: AVX2 ones; default {here})")
    p.add_argument("--overwrite", action="store_true",
                   help="DST may hold other files: replace only the files quantize writes there")
    return p
