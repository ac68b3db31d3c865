"""Rank-side tensor-parallel checks (used by test_tensor_parallel.py).

Each function builds the same seeded tiny model on every rank, keeps an unsharded copy as the
single-process reference (no communication touches it), shards the other and compares.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tiny_models import VOCAB, batches, build
from tolerance import equivalence_tol, flip_mlp
from zero_cases import max_rel_diff, row_losses

from shardwise.inference.tensor_parallel import init_inference
from shardwise.layout import get_mesh
from shardwise.tensor_parallel import (
    apply_tensor_parallel,
    gather_state_dict,
    tp_grad_norm,
    tp_state_of,
    vocab_parallel_cross_entropy,
)

GEN = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}


def _prompt(b: int = 2, s: int = 5) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(7))


def forward_and_generate(kind: str, tp_size: int) -> dict:
    """Logits and greedy tokens of the TP model vs the unsharded one, plus forward comm bytes."""
    ref, model = build(kind).eval(), build(kind).eval()
    mesh = get_mesh(tp_size)
    report = apply_tensor_parallel(model, mesh.tp)
    ids = _prompt(2, 8)
    before = dict(mesh.stats.as_dict())
    with torch.no_grad():
        got, want = model(input_ids=ids).logits, ref(input_ids=ids).logits
    after = mesh.stats.as_dict()
    fwd = {k: after[k] - before.get(k, 0) for k in after}
    with torch.no_grad():
        tok, ref_tok = model.generate(_prompt(), **GEN), ref.generate(_prompt(), **GEN)
    cfg = model.config
    return {"max_abs": float((got - want).abs().max()), "scale": float(want.abs().max()),
            "shape_ok": got.shape == want.shape, "tokens": tok.tolist(), "ref_tokens": ref_tok.tolist(),
            "source": report.plan_source, "tied": report.tied, "fwd_comm": fwd,
            "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "bs": tuple(ids.shape),
            "local_numel": sum(p.numel() for p in model.parameters()),
            "full_numel": sum(p.numel() for p in ref.parameters())}


def cross_entropy(tp_size: int = 2, n: int = 12, vocab: int = VOCAB) -> dict:
    """Vocab-parallel CE (padded vocabulary, ignore_index) vs F.cross_entropy: loss and grads."""
    tp = get_mesh(tp_size).tp
    g = torch.Generator().manual_seed(3)
    full = torch.randn(n, vocab, generator=g, dtype=torch.float64) * 3
    target = torch.randint(0, vocab, (n,), generator=g)
    target[2] = -100
    local_n = -(-vocab // tp.size)
    start = tp.rank * local_n
    local = torch.zeros(n, local_n, dtype=torch.float64)
    width = max(0, min(local_n, vocab - start))
    local[:, :width] = full[:, start:start + width]
    local.requires_grad_(True)
    full.requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, target, tp, vocab_size=vocab)
    loss.backward()
    want = F.cross_entropy(full, target, ignore_index=-100)
    want.backward()
    grad_diff = float((local.grad[:, :width] - full.grad[:, start:start + width]).abs().max())
    pad_grad = float(local.grad[:, width:].abs().max()) if width < local_n else 0.0
    per_tok = vocab_parallel_cross_entropy(local.detach(), target, tp, vocab_size=vocab, reduction="none")
    per_diff = float((per_tok - F.cross_entropy(full.detach(), target, reduction="none")).abs().max())
    return {"loss": float(loss.detach()), "want": float(want.detach()), "grad_diff": grad_diff,
            "pad_grad": pad_grad, "per_token_diff": per_diff}


def train(kind: str, tp_size: int = 2, steps: int = 3, seq: int = 8, micro: int = 2) -> dict:
    """TP=t with plain torch AdamW vs the same model and optimizer in one process, same batches."""
    ref, model = build(kind), build(kind)
    mesh = get_mesh(tp_size)
    apply_tensor_parallel(model, mesh.tp)
    kw = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    opt, ref_opt = torch.optim.AdamW(model.parameters(), **kw), torch.optim.AdamW(ref.parameters(), **kw)
    data = batches(steps, 1, micro, seq)
    losses, ref_losses, norms, replicated_grads = [], [], [], {}
    for s in range(steps):
        ids = data[s, 0]
        out, ref_out = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
        out.loss.backward()
        ref_out.loss.backward()
        norms.append((float(tp_grad_norm(model.parameters(), mesh.tp)),
                      float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]))))
        if s == 0:
            first_key_bias_grad = max((float(p.grad.view(3, -1)[1].abs().max()) for n, p in
                                       ref.named_parameters() if n.endswith("c_attn.bias")), default=0.0)
            replicated_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p._tp_spec is None}
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        losses.append(float(out.loss.detach()))
        ref_losses.append(float(ref_out.loss.detach()))
    full = gather_state_dict(model)
    want = {n: p.detach().clone() for n, p in ref.named_parameters()}
    other, other_losses, other_norms = _row_split_reference(kind, data, kw)
    key_bias_grad = 0.0
    if kind == "gpt2":  # the key bias has an analytically zero gradient (softmax ignores a shift of
        # the scores per query), so Adam turns rounding noise (~1e-10) into lr-sized steps in any
        # implementation: leave it out of the weight comparison, and check that it is noise
        h = ref.config.n_embd
        for n in full:
            if n.endswith("attn.c_attn.bias"):
                full[n][h:2 * h] = want[n][h:2 * h] = other[n][h:2 * h] = 0.0
        key_bias_grad = first_key_bias_grad
    rel = lambda a, b: abs(a - b) / max(abs(b), 1e-12)  # noqa: E731
    noise = {"weights": max_rel_diff(other, want, floor=0.0),  # key bias already left out above
             "norm": max(float((other[n] - want[n]).norm() / want[n].norm()) for n in want),
             "loss": max(rel(a, b) for a, b in zip(other_losses, ref_losses, strict=True)),
             "grad_norm": max(rel(a, want_n) for a, (_, want_n) in zip(other_norms, norms, strict=True))}
    return {"losses": losses, "ref_losses": ref_losses, "weights": full if dist.get_rank() == 0 else None,
            "ref_weights": want if dist.get_rank() == 0 else None, "norms": norms,
            "replicated_grads": replicated_grads, "n_params": len(full), "n_ref": len(want),
            "key_bias_grad": key_bias_grad, "noise": noise, "tol": equivalence_tol(noise, steps)}


def _row_split_reference(kind: str, data: torch.Tensor, kw: dict) -> tuple[dict, list, list]:
    """The single-process reference again, MLP units reversed and one forward per row: the same
    math, other summation orders (tests/tolerance.py)."""
    model = build(kind)
    flip_mlp(model)
    opt = torch.optim.AdamW(model.parameters(), **kw)
    losses, norms = [], []
    for s in range(data.shape[0]):
        ids = data[s, 0]
        rows = []
        for row in ids:  # forward and backward per row: other GEMM shapes and summation order
            loss = row_losses(model, row[None])
            (loss.sum() / ids.shape[0]).backward()
            rows.append(loss.detach())
        per_row = torch.cat(rows)
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))
        opt.step()
        opt.zero_grad()
        losses.append(float(per_row.mean()))
    flip_mlp(model)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses, norms


def backward_comm(kind: str, tp_size: int = 2) -> dict:
    """All-reduce bytes of a backward through the TP model (no loss all-reduces: sum of logits)."""
    model = build(kind)
    mesh = get_mesh(tp_size)
    apply_tensor_parallel(model, mesh.tp)
    ids = _prompt(2, 8)
    out = model(input_ids=ids).logits.sum()
    before = mesh.stats.as_dict()["all_reduce"]
    out.backward()
    return {"bwd_all_reduce": mesh.stats.as_dict()["all_reduce"] - before}


def bad_degree(tp_size: int = 2) -> list[str]:
    """The messages for heads (GPT-2 with 3 heads) and kv heads (Llama with 1 kv head) not divisible."""
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    tp = get_mesh(tp_size).tp
    configs = [GPT2Config(vocab_size=VOCAB, n_embd=48, n_layer=1, n_head=3, n_positions=32),
               LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=1)]
    messages = []
    for cfg in configs:
        try:
            apply_tensor_parallel(AutoModelForCausalLM.from_config(cfg), tp)
            messages.append("no error")
        except ValueError as e:
            messages.append(str(e))
    return messages


def inference_from_dir(path: str, tp_size: int = 2) -> dict:
    """init_inference(dir): bytes read per rank and greedy tokens."""
    from safetensors import safe_open

    model = init_inference(path, tensor_parallel_size=tp_size)
    report = tp_state_of(model).report
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        sizes = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118

    def nbytes(shape) -> int:
        return int(torch.tensor(shape).prod()) * 4

    sharded_full = sum(nbytes(sizes[n]) for n in report.sharded)
    sharded_local = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                        if n in report.sharded)
    with torch.no_grad():
        tok = model.generate(_prompt(), **GEN)
    return {"tokens": tok.tolist(), "loaded": tp_state_of(model).bytes_loaded,
            "file_bytes": sum(map(nbytes, sizes.values())), "sharded_full": sharded_full,
            "sharded_local": sharded_local, "source": report.plan_source}


def sampling(kind: str, tp_size: int = 2) -> list[list[int]]:
    """Sampled tokens after seeding each rank differently: the shared seed must make them agree."""
    model = init_inference(build(kind), tensor_parallel_size=tp_size)
    torch.manual_seed(1000 + dist.get_rank())
    with torch.no_grad():
        out = model.generate(_prompt(1, 4), max_new_tokens=8, do_sample=True, top_k=0, pad_token_id=0)
    return out.tolist()
