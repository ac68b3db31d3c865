"""Quantized streaming (int8/int4, group-wise): exact against a dequantized reference, fewer bytes
per token, and perplexity on a briefly trained model within 1% (int8) / 5% (int4) of unquantized."""

from __future__ import annotations

import json
import math
import os
import shutil
from types import SimpleNamespace

import pytest
import torch
from inference_cases import GEN, perplexity, prompt, save_tiny, stream, train_sonnets

from shardwise.inference.load import init_inference
from shardwise.inference.quant_format import (
    DESCRIPTION,
    blocked_names,
    dequantize_tensor,
    quantizable,
    quantize_tensor,
    scale_dtype,
    stored_form,
)
from shardwise.inference.quantize import quantize_folder
from shardwise.inference.quantized_linear import (
    Int4Linear,
    install,
    kernel_available,
    scale_pairs,
    write_block_rows,
)
from shardwise.inference.quantized_store import QuantizedStore
from shardwise.inference.stream import stream_state_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GROUP = 32


@pytest.mark.parametrize(("bits", "sdtype"), [(8, torch.float16), (4, torch.float16), (4, torch.bfloat16)])
def test_quantize_tensor_rounds_to_nearest_level(bits, sdtype):
    w = torch.randn(37, 50) * torch.rand(37, 1)  # rows of different scales; 1850 = not whole groups
    packed, scale = quantize_tensor(w, bits, GROUP, sdtype)
    assert scale.dtype == sdtype
    back = dequantize_tensor(packed, scale, bits, GROUP, tuple(w.shape), torch.float32)
    s = scale.float().repeat_interleave(GROUP)[:w.numel()].view_as(w)
    # nearest level: half a step, plus the rounding of the scale at the clamped end (qmax * half an ulp
    # of the scale's dtype in steps: 2^-11 for fp16, 2^-8 for bf16)
    qmax, half_ulp = (1 << (bits - 1)) - 1, 2.0**-11 if sdtype == torch.float16 else 2.0**-8
    assert ((w - back).abs() <= s * (0.5 + qmax * half_ulp) + 1e-7).all()
    assert packed.numel() == math.ceil(w.numel() / GROUP) * GROUP * bits // 8


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("quant")
    plain = str(base / "plain")
    save_tiny("llama", plain)
    out = {"plain": plain}
    for bits in (8, 4):
        out[bits] = str(base / f"int{bits}")
        # int4 in 64-row blocks (AVX-512's order): the tiny model then has weights of both kinds
        quantize_folder(plain, out[bits], bits, GROUP, block_rows=64)
    out["int4_rows32"] = str(base / "int4_rows32")  # AVX2's order: every weight of the tiny model blocked
    quantize_folder(plain, out["int4_rows32"], 4, GROUP, block_rows=32)
    return out


def _dequantized_reference(folder: str, bits: int, kernel: bool = True, rows: int = 64) -> list:
    """Plain transformers, resident, with every quantizable weight replaced by its dequantized
    value; with ``kernel`` (what streaming does on CPU), the int4 Linear weights the kernel takes
    are instead kept packed in an Int4Linear, as the streamed model computes them (when the
    running torch packs in blocks of ``rows``: else they are dequantized there too)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    names = quantizable(model)
    blocked = blocked_names(model, names, bits, GROUP, rows)  # their scales are chosen in bf16
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if n in names}
    if kernel:
        install(model, SimpleNamespace(blocked=blocked, group=GROUP, block_rows=rows), torch.float32,
                torch.device("cpu"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in names:
                q = quantize_tensor(p, bits, GROUP, scale_dtype(name in blocked))
                p.copy_(dequantize_tensor(*q, bits, GROUP, tuple(p.shape), p.dtype))
        for name, mod in model.named_modules():
            if isinstance(mod, Int4Linear):
                w = weights[f"{name}.weight"]
                packed, scale = stored_form(w, tuple(w.shape), bits, GROUP, rows=rows)
                mod.weight_packed.copy_(packed.view(torch.float32))
                mod.weight_scale.copy_(scale_pairs(scale, torch.float32))
        return model.generate(prompt(), **GEN).tolist()


@pytest.mark.parametrize("bits", [8, 4, "int4_rows32"])
def test_store_reads_any_element_range(folders, bits):
    """Dequantized reads of any range, in the flat order and (int4) in the kernel's blocked orders."""
    from safetensors.torch import load_file

    plain = load_file(os.path.join(folders["plain"], "model.safetensors"))
    store = QuantizedStore.open(folders[bits], resident=False)
    assert store.block_rows == (32 if bits == "int4_rows32" else 64)
    keys = sorted(store.qshapes)
    if bits == 4:
        assert store.blocked and set(keys) - store.blocked  # the tiny model has both kinds
        keys = [min(store.blocked), min(set(keys) - store.blocked)]
    if bits == "int4_rows32":
        assert store.blocked == set(keys)  # 32-row blocks: k/v (32 rows) and gate/up (96) too
        keys = [k for k in keys if store.qshapes[k][0] == 96][:1] + [k for k in keys if store.qshapes[k][0] == 32][:1]
    bits = 4 if bits == "int4_rows32" else bits
    for key in keys[:2]:
        n = math.prod(store.qshapes[key])
        whole = store.read(key, 0, n)
        w = plain[key]
        q = quantize_tensor(w, bits, GROUP, scale_dtype(key in store.blocked))
        assert torch.equal(whole.view(w.shape), dequantize_tensor(*q, bits, GROUP, tuple(w.shape), w.dtype))
        for a, b in [(0, 1), (5, 77), (GROUP, 3 * GROUP), (n - 40, n), (1, n - 1)]:
            assert torch.equal(store.read(key, a, b), whole[a:b])
    assert store.qdtype == torch.float32
    if bits == 4:  # an Int4Linear's parameters, as the store serves them: the kernel's (scale, 0) pairs
        key = min(store.blocked)
        store.packed_in_use = {key}
        w = plain[key]
        want = scale_pairs(stored_form(w, tuple(w.shape), 4, GROUP, rows=store.block_rows)[1], torch.float32)
        got = store.read(f"{key}_scale", 0, want.numel(), torch.empty(want.numel()))
        assert torch.equal(got, want)
        for a, b in [(1, 2), (3, 70), (want.numel() - 5, want.numel())]:
            assert torch.equal(store.read(f"{key}_scale", a, b, torch.empty(b - a)), want[a:b])
        buffer = torch.full((want.numel() + 3,), 7.0, dtype=torch.bfloat16)  # bf16: the one-op path, and not
        for a, b, at in [(0, want.numel(), 0), (0, want.numel(), 1), (4, 70, 2), (3, 70, 0)]:
            out = buffer[at:at + b - a]
            assert torch.equal(store.read(f"{key}_scale", a, b, out).float(), want[a:b])


def test_row_by_row_reads_of_a_blocked_weight_read_it_once(folders):
    """A row-parallel TP slice is read one row at a time: each row's columns equal the whole read's,
    and each block is read and dequantized once, not once per row of it (32x)."""
    store = QuantizedStore.open(folders["int4_rows32"], resident=False)
    key = next(k for k in sorted(store.blocked) if store.qshapes[k][0] == 96)
    rows, cols = store.qshapes[key]
    whole = store.read(key, 0, rows * cols).view(rows, cols)
    blocks = rows // store.block_rows  # each block's dequantization reads the kernel-order scales whole
    once = store.tensors[key].nbytes + blocks * store.tensors[f"{key}.scale"].nbytes
    before = store.bytes_read
    half = slice(cols // 2, cols)  # rank 1's half of a row-parallel weight
    got = torch.stack([store.read(key, r * cols + cols // 2, (r + 1) * cols) for r in range(rows)])
    assert torch.equal(got, whole[:, half])
    assert store.bytes_read - before == once, (store.bytes_read - before, once)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_streaming_equals_dequantized_model(folders, bits):
    """From the quantized copy on disk, and quantized at load for offload="cpu": the tokens of the
    same model with its weights dequantized; from disk, about bits/32 of the bytes per token."""
    want = _dequantized_reference(folders["plain"], bits)
    disk = stream(folders[bits], "disk")
    assert disk["tokens"] == want
    # quantized at load: int4 in this torch's order (64-row blocks where it has no kernel)
    rows = write_block_rows()
    cpu = init_inference(folders["plain"], offload="cpu", quantize=f"int{bits}", group_size=GROUP)
    assert cpu.generate(prompt(), **GEN).tolist() == (
        want if bits == 8 or rows == 64 else _dequantized_reference(folders["plain"], bits, rows=rows))
    kernels = sum(isinstance(m, Int4Linear) for m in cpu.modules())
    # blocks of 64: q, o, down of 2 layers (k/v: 32 rows, gate/up: 96); blocks of 32: all 7 of each layer
    assert kernels == ({64: 6, 32: 14}[rows] if bits == 4 and kernel_available() else 0)
    # offload="cpu" keeps the root and the packed weights, no dequantized copy (norms: from the file)
    state = stream_state_of(cpu)
    root = sum(g.memory()["params"] for g in state.groups[-1])
    sizes = [math.prod(shape) for shape in state.files.qshapes.values()]
    packed = sum(math.ceil(n / GROUP) * (GROUP * bits // 8 + 2) for n in sizes)
    assert cpu.memory_report()["params"] == root + packed
    plain = stream(folders["plain"], "disk")
    # per layer element bits/8 bytes + one fp16 scale per group, against 4 (norm weights: ~0.4%);
    # the root (embeddings, head) is read once at load and stays resident in both
    layers_q, layers_plain = (r["bytes_read"] - r["root_bytes"] for r in (disk, plain))
    assert layers_q <= layers_plain * ((bits / 8 + 2 / GROUP) / 4 + 0.01)


def test_streaming_a_file_in_either_kernel_order(folders):
    """An int4 file in 32-row blocks (what an AVX2 machine writes) and one in 64-row blocks (AVX-512):
    on a CPU whose torch packs in that order the kernel takes the weights as read, on any other they
    are dequantized per layer; either way the tokens are those of the same computation done resident."""
    for key, rows, blocked in [("int4_rows32", 32, 14), (4, 64, 6)]:
        want = _dequantized_reference(folders["plain"], 4, rows=rows)
        model = init_inference(folders[key], offload="disk")
        assert model.generate(prompt(), **GEN).tolist() == want, rows
        assert sum(isinstance(m, Int4Linear) for m in model.modules()) == (blocked if kernel_available(rows) else 0)


def test_quantized_folder_mismatches_are_refused(folders):
    with pytest.raises(ValueError, match="quantized to 8 bits"):
        init_inference(folders[8], offload="disk", quantize="int4")
    with pytest.raises(ValueError, match="groups of 32"):
        init_inference(folders[4], offload="disk", group_size=64)
    with pytest.raises(ValueError, match="offload"):
        init_inference(folders[4])  # resident transformers would read packed bytes as weights
    with pytest.raises(ValueError, match="offload"):
        init_inference(folders[4], tensor_parallel_size=2)  # refused before any process group is needed
    with pytest.raises(ValueError, match="already quantized"):
        quantize_folder(folders[4], folders[4] + "_again", 4, GROUP)


def test_format_versions_refused_unless_read_alike(folders, tmp_path):
    """Format 2 keeps the int4 kernel weights' scales in BF16 in the kernel's order; a format-1 file
    (row-major F16 there) is refused, never misread. An int8 format-1 file holds the same bytes.
    Format 3 records the block rows; a format-2 file (``rows64``, no block rows) reads as 64-row
    blocks, and block rows other than 64 and 32 are refused."""
    store = QuantizedStore.open(folders[4], resident=False)
    for key in store.qshapes:
        assert store.tensors[f"{key}.scale"].dtype == (torch.bfloat16 if key in store.blocked else torch.float16)
    cases = [(4, None, "format 1", None), (4, 4, "format_version 4", None), (8, None, None, None),
             (4, 2, None, None), (4, 3, "block_rows 48", 48), (4, 3, "block_rows '32'", "32")]
    for bits, version, refused, rows in cases:
        folder = tmp_path / f"int{bits}_v{version}_{rows}"
        shutil.copytree(folders[bits], folder)
        desc = json.loads((folder / DESCRIPTION).read_text())
        assert desc.pop("format_version") == 3 and desc["block_rows"] == 64
        if version is not None:
            desc["format_version"] = version
        if version is None or version == 2:  # as formats 1-2 wrote it
            desc["rows64"], _ = desc.pop("blocked"), desc.pop("block_rows")
        if rows is not None:
            desc["block_rows"] = rows
        (folder / DESCRIPTION).write_text(json.dumps(desc))
        if refused is None:
            opened = QuantizedStore.open(str(folder), resident=False)
            assert opened.bits == bits and opened.block_rows == 64
            assert opened.blocked == (store.blocked if bits == 4 else set())
            continue
        with pytest.raises(ValueError, match=refused):
            QuantizedStore.open(str(folder), resident=False)


def test_two_rank_quantized_streaming(pool2, folders):
    """Stage-3 sharding over 2 ranks: each reads its byte range of the packed int4 weights (the
    Int4Linear parameters included) and the all-gather rebuilds them bit for bit."""
    want = _dequantized_reference(folders["plain"], 4)
    assert [r["tokens"] for r in pool2.run("inference_cases:stream", folders[4], "disk")] == [want, want]


def test_tensor_parallel_quantized_streaming(pool2, folders):
    """Tensor-parallel slices are dequantized per layer (no kernel form), the blocked order included."""
    want = _dequantized_reference(folders["plain"], 4, kernel=False)
    assert pool2.run("inference_cases:tensor_parallel", folders[4], "disk") == [want, want]


def test_perplexity_of_trained_model(tmp_path):
    """int8 within 1%, int4 within 5% of the unquantized perplexity on the sonnets."""
    plain = str(tmp_path / "plain")
    ids = train_sonnets(plain)
    base = perplexity(init_inference(plain, offload="disk"), ids)
    assert base < 12, base  # it learned the text (uniform over the characters would be ~60)
    for bits, tol in ((8, 0.01), (4, 0.05)):
        quantize_folder(plain, str(tmp_path / f"q{bits}"), bits, GROUP)
        ppl = perplexity(init_inference(str(tmp_path / f"q{bits}"), offload="disk"), ids)
        assert abs(ppl / base - 1) <= tol, (bits, ppl, base)


def test_quantize_cli_then_generate(folders, tmp_path, capsys):
    """The two commands' own entries (``shardwise quantize``, then ``shardwise generate`` on its output),
    in this process: what they write and print; their exit codes as the OS sees them and one-line
    errors are tests/test_cli_errors.py's."""
    from shardwise.cli import generate as generate_cli
    from shardwise.cli import quantize as quantize_cli

    dst = str(tmp_path / "q4")
    assert quantize_cli.main([folders["plain"], dst, "--bits", "4", "--group-size", str(GROUP)]) == 0
    assert "4 bits" in capsys.readouterr().out
    assert generate_cli.main(["--model", dst, "--prompt", "w1 w2", "--max-new-tokens", "4", "--offload", "disk"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "read per token" in out and "peak memory" in out, out
    # (bad arguments: tests/test_cli_errors.py, in one process with the other CLI errors)
