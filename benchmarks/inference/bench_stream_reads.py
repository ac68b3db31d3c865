"""Where a streamed token's reads and CPU go: read order, and CPU per thread.

    python benchmarks/inference/bench_stream_reads.py FOLDER [--repeats 3 --tokens 8]

FOLDER: a saved model (e.g. the ``int4`` folder ``bench_inference.py --quantized --folder F``
writes under F). Two measurements, both with cold reads (pages dropped after each read, as
``SHARDWISE_COLD_READS=1`` does):

* **read order**: every decoder layer's tensors read once in the model's order (q, k, v, o, gate,
  up, down, then the norms, each weight before its ``.scale``) and once in file order, ``--repeats``
  times: the case for ``zero/store.read_segments`` sorting a gather's reads by file position;
* **the int4 kernel alone** on a token's matmuls (the file's blocked shapes, random weights, resident);
* **the scale pairs alone**: one widening op (``pairs_into``) against three ops, for a token's weights;
* **CPU per thread** of a streamed generate (``offload="disk"``, prefetch 1, after a warm-up), from
  ``/proc/self/task/*/schedstat``, and the reader's CPU inside ``preadv`` and ``posix_fadvise``.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
USE_ORDER = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"]


def _model_order(keys: list[str]) -> list[str]:
    def rank(key: str) -> tuple:
        layer = int(re.search(r"layers\.(\d+)\.", key).group(1))
        part = next((i for i, p in enumerate(USE_ORDER) if f".{p}." in key), len(USE_ORDER))
        return layer, part, key.endswith(".scale")
    return sorted((k for k in keys if re.search(r"layers\.\d+\.", k)), key=rank)


def read_order(folder: str, repeats: int) -> None:
    import torch

    from shardwise.files.safetensors_io import SafetensorsFile

    f = SafetensorsFile(os.path.join(folder, "model.safetensors"))
    keys = _model_order(list(f.tensors))
    bufs = {k: torch.empty(f.tensors[k].nbytes, dtype=torch.uint8) for k in keys}
    total = sum(b.numel() for b in bufs.values())
    for _ in range(repeats):
        for name, order in (("model order", keys), ("file order", sorted(keys, key=lambda k: f.tensors[k].offset))):
            os.posix_fadvise(f.fd, 0, f.size, os.POSIX_FADV_DONTNEED)
            t = time.perf_counter()
            for k in order:
                f.read_raw(k, 0, bufs[k])
            dt = time.perf_counter() - t
            print(f"{name}: {len(order)} reads, {total / 1e6:.1f} MB in {dt * 1e3:.1f} ms", flush=True)
    f.close()


def _threads() -> dict[str, tuple[int, int]]:
    out = {}
    for task in glob.glob("/proc/self/task/*"):
        try:
            run, wait, _ = map(int, open(f"{task}/schedstat").read().split())
        except OSError:
            continue
        out[task.rsplit("/", 1)[1]] = (run, wait)
    return out


def cpu_per_thread(folder: str, tokens: int) -> None:
    import torch

    import shardwise.files.safetensors_io as sio
    from shardwise.inference.load import init_inference

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from inference_cases import prompt

    spent = {"preadv": 0.0, "fadvise": 0.0}
    plain_read, plain_fadvise = sio.read_into, os.posix_fadvise

    def read_into(*args):
        t = time.thread_time()
        plain_read(*args)
        spent["preadv"] += time.thread_time() - t

    def fadvise(*args):
        t = time.thread_time()
        plain_fadvise(*args)
        spent["fadvise"] += time.thread_time() - t

    sio.read_into, os.posix_fadvise = read_into, fadvise
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    model = init_inference(folder, offload="disk", prefetch=1)
    ids, gen = prompt(vocab=512, batch=1, seq=8), {"do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, **gen)
        spent.update(dict.fromkeys(spent, 0.0))
        before, t = _threads(), time.perf_counter()
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **gen)
        wall, after = time.perf_counter() - t, _threads()
    print(f"{1e3 * wall / tokens:.1f} ms a token; CPU per token by thread (run / runqueue wait, ms):")
    for tid, (run, wait) in after.items():
        if tid in before and run - before[tid][0] > 0.5e6 * tokens:
            ran, waited = (run - before[tid][0]) / 1e6 / tokens, (wait - before[tid][1]) / 1e6 / tokens
            print(f"  thread {tid}: {ran:.1f} / {waited:.1f}")
    per_token = [1e3 * v / tokens for v in spent.values()]
    print("  of which in preadv {:.1f}, in posix_fadvise {:.1f}".format(*per_token))


def kernel_alone(folder: str, repeats: int) -> None:
    """The int4 kernel on a token's worth of this model's Int4Linear shapes, weights resident, M = 1."""
    import torch

    from shardwise.inference.quant_format import DESCRIPTION

    desc = __import__("json").load(open(os.path.join(folder, DESCRIPTION)))
    shapes = [tuple(desc["tensors"][k]) for k in desc.get("blocked", [])]
    group, g = desc["group_size"], torch.Generator().manual_seed(0)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    calls = [(torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32,
                                                                               generator=g), 1),
              torch.rand(k // group, n, 2, generator=g).to(torch.bfloat16), torch.randn(1, k).to(torch.bfloat16))
             for n, k in shapes]
    for _ in range(repeats):
        t = time.perf_counter()
        for packed, scales, x in calls:
            torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales)
        print(f"int4 kernel alone: {len(calls)} matmuls (a token) in {1e3 * (time.perf_counter() - t):.1f} ms")


def pairs_alone(folder: str, repeats: int) -> None:
    """The kernel's (scale, 0) pairs of each blocked weight's scales: one widening op (``pairs_into``,
    what the store does) against the strided copy, zero and copy it replaced."""
    import torch

    from shardwise.inference.quant_format import DESCRIPTION
    from shardwise.inference.quantized_linear import pairs_into

    desc = __import__("json").load(open(os.path.join(folder, DESCRIPTION)))
    counts = [n * k // desc["group_size"] for n, k in (desc["tensors"][key] for key in desc.get("blocked", []))]
    scales = [torch.rand(c).to(torch.bfloat16) for c in counts]
    outs = [torch.empty(2 * c, dtype=torch.bfloat16) for c in counts]
    stage = torch.empty(2 * max(counts), dtype=torch.bfloat16)
    for _ in range(repeats):
        t = time.perf_counter()
        for s, o in zip(scales, outs, strict=True):
            pairs_into(o, s)
        one = time.perf_counter() - t
        t = time.perf_counter()
        for s, o in zip(scales, outs, strict=True):
            pairs = stage[:o.numel()].view(-1, 2)
            pairs[:, 0].copy_(s)
            pairs[:, 1].zero_()
            o.copy_(pairs.view(-1))
        three = time.perf_counter() - t
        print(f"scale pairs of {len(counts)} weights (a token): one op {1e3 * one:.2f} ms, "
              f"three ops {1e3 * three:.2f} ms")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("folder")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=8)
    args = p.parse_args()
    sys.path.insert(0, ROOT)
    os.environ["SHARDWISE_COLD_READS"] = "1"
    read_order(args.folder, args.repeats)
    kernel_alone(args.folder, args.repeats)
    pairs_alone(args.folder, args.repeats)
    cpu_per_thread(args.folder, args.tokens)


if __name__ == "__main__":
    main()
