"""``engine.generate(...)`` on a pipeline of a Hugging Face causal LM: decoding that runs through the stages.

No rank holds the whole model, so the decode is pipelined as the training is: at each step the first
stage embeds the new tokens, each stage runs its decoder layers with its own key/value cache (a
``DynamicCache`` holding only its layers) and sends the hidden states on through the pipeline's
guarded :class:`~shardwise.comm.PointToPoint` (``pipeline/wire.py``, counted in ``comm_stats()``), and
the last stage computes the last position's logits, picks the next tokens and broadcasts them to
every stage, which append them (so every stage returns the same sequences and stops together).

The choice is HF's ``generate()``'s, step for step: the model's generation config updated by the
call's arguments, HF's defaults where both leave a field unset (``max_length`` 20, ``top_k`` 50, ...),
the logits in fp32, the caller's ``logits_processor`` first, then temperature, top-k and top-p (when
sampling), then ``argmax`` or ``torch.multinomial`` on the softmax, finished rows padded, a row
finished at its ``eos_token_id``. The layers compute what the unsplit model computes (the same mask,
positions and rotary embeddings per step; the head on the last position only), so greedy decoding
gives HF's tokens, and sampling too when the last stage's generator is seeded as the single
process's was. Served: greedy and sampling of a batch without padding (``attention_mask`` all ones);
beams, penalties and the other processors are refused in one line.

A processor that raises on the last stage (``shardwise train``'s non-finite-logits guard) ends every
stage: the last broadcasts a stop and the error's line, and the others raise :class:`StageStopped`
carrying it. A stage whose layers or receive fail tells the next (the stop header), which fails its
receive naming it and passes the stop on, so the last stage's broadcast ends every stage at once, each
with its own line (the failing stage its error, the others the last stage's).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch

from shardwise.comm import RanksDivergedError
from shardwise.engine.compat import UsageError
from shardwise.pipeline.hf import DecoderLayer, Embedding, Head, Norm, tied_head
from shardwise.pipeline.wire import STOPPED

SERVED = {"input_ids", "attention_mask", "max_new_tokens", "max_length", "do_sample", "temperature", "top_k",
          "top_p", "pad_token_id", "eos_token_id", "logits_processor", "generation_config", "use_cache"}
DEFAULTS = {"max_length": 20, "do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "num_beams": 1,
            "num_return_sequences": 1}
UNSERVED = ("num_beams", "num_return_sequences", "repetition_penalty", "min_length", "min_new_tokens", "min_p",
            "top_h", "typical_p", "epsilon_cutoff", "eta_cutoff", "no_repeat_ngram_size", "bad_words_ids",
            "forced_bos_token_id", "forced_eos_token_id", "suppress_tokens", "begin_suppress_tokens", "sequence_bias",
            "guidance_scale", "stop_strings", "renormalize_logits", "remove_invalid_values")
MESSAGE_BYTES = 1024


class StageStopped(RuntimeError):
    """The last stage stopped the decode with an error of its own (``kind``: its class name)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _config(module: Any, kwargs: dict) -> Any:
    """The generation config as HF's ``generate`` resolves it (the model's, the call's, HF's defaults)."""
    from transformers import GenerationConfig

    unknown = sorted(set(kwargs) - SERVED)
    if unknown:
        raise UsageError(f"generate() on a pipeline: {', '.join(unknown)} not served (served: greedy and sampling "
                         f"with {', '.join(sorted(SERVED - {'input_ids'}))})")
    base = kwargs.get("generation_config") or getattr(module, "hf_generation_config", None)
    gen = copy.deepcopy(base) if base is not None else GenerationConfig.from_model_config(module.hf_config)
    gen.update(**{k: v for k, v in kwargs.items() if k not in ("input_ids", "attention_mask", "logits_processor",
                                                                "generation_config")})
    for key, value in DEFAULTS.items():
        if getattr(gen, key, None) is None:
            setattr(gen, key, value)
    bad = [k for k in UNSERVED if getattr(gen, k, None) not in (None, DEFAULTS.get(k), 0, 1.0, False)]
    if bad:
        raise UsageError(f"generate() on a pipeline: {', '.join(bad)} not served (greedy or sampling with "
                         "temperature, top_k and top_p only)")
    return gen


def _processors(gen: Any, custom: Any) -> list:
    """HF's order: the caller's processors, then (sampling) temperature, top-k, top-p."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    out = list(custom or [])
    if gen.do_sample:
        if gen.temperature != 1.0:
            out.append(TemperatureLogitsWarper(gen.temperature))
        if gen.top_k:
            out.append(TopKLogitsWarper(top_k=gen.top_k, min_tokens_to_keep=1))
        if gen.top_p < 1.0:
            out.append(TopPLogitsWarper(top_p=gen.top_p, min_tokens_to_keep=1))
    return out


def _run_chunk(module: Any, chunk: int, x: torch.Tensor, past: int, cache: Any) -> torch.Tensor:
    """This rank's entries of ``chunk`` on ``x`` (token ids on the first stage, else hidden states)."""
    first, stop = module.chunk_funcs[chunk]
    for f in module.forward_funcs[first:stop]:
        if isinstance(f, DecoderLayer):
            x = f.decode(x, past, cache)
        elif isinstance(f, Head):  # HF: the final norm over every position, the head on the last one
            x = f.head(f.norm(x)[:, -1:])
        elif isinstance(f, functools.partial) and f.func is tied_head:
            x = f(x[:, -1:])
        elif isinstance(f, (Embedding, Norm)):
            x = f(x)
        else:
            raise UsageError(f"generate() on a pipeline: the stage holds a {type(f).__name__}, not an entry of a "
                             "Hugging Face model split by pipeline.stages")
    return x


def _through_chunks(engine: Any, new: torch.Tensor, past: int, cache: Any) -> torch.Tensor:
    """One step through this rank's chunks (one without virtual stages; with them the hidden states go
    round the ranks ``virtual`` times): each receives from the previous virtual stage and sends to the next,
    except the first (the new tokens) and the last (the logits, returned)."""
    p, s, v = engine.num_stages, engine.stage_id, engine.virtual
    x = new
    for c in range(v):
        if not (s == 0 and c == 0):
            x = engine.link.recv((s - 1) % p, f"the decode's hidden states at position {past}", engine.device)[0]
        x = _run_chunk(engine.module, c, x, past, cache)
        if not (s == p - 1 and c == v - 1):
            engine.link.send((x,), (s + 1) % p)
    return x


def _stop_downstream(engine: Any) -> None:
    """This stage failed in its layers or a receive: the next stage, waiting for its hidden states, is told
    (the stop header of ``pipeline/wire.py``), fails its receive naming this stage and tells the next, so
    the last stage learns it and every stage meets at ``_share``'s broadcast, which ends them all."""
    link, s, p = engine.link, engine.stage_id, engine.num_stages
    nxt = (s + 1) % p
    if (engine.is_last_stage() and engine.virtual == 1) or nxt == link.stopped_peer:
        return
    try:  # kept, not waited for: the work must outlive this call for the bytes to leave
        link.stopping.append(link.p2p.send(torch.tensor([STOPPED], dtype=torch.int64, device=link.device), nxt))
    except RanksDivergedError:
        pass  # that stage is gone; this stage's own error is raised by the caller


def _eos(gen: Any, device: torch.device) -> torch.Tensor | None:
    eos = gen.eos_token_id
    if eos is None:
        return None
    return torch.tensor(eos if isinstance(eos, list) else [eos], dtype=torch.long, device=device)


def _pick(logits: torch.Tensor, ids: torch.Tensor, gen: Any, processors: list, state: dict) -> torch.Tensor:
    """The next tokens (last stage): HF's ``_sample`` step, finished rows padded and marked."""
    scores = logits[:, -1].to(copy=True, dtype=torch.float32)
    for p in processors:
        scores = p(ids, scores)
    if gen.do_sample:
        tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
    else:
        tokens = torch.argmax(scores, dim=-1)
    eos, unfinished = state["eos"], state["unfinished"]
    if eos is not None:
        pad = gen.pad_token_id if gen.pad_token_id is not None else int(eos[0])
        tokens = tokens * unfinished + pad * (1 - unfinished)
        state["unfinished"] = unfinished & ~torch.isin(tokens, eos).long()
    return tokens


def _share(engine: Any, tokens: torch.Tensor | None, state: dict, error: BaseException | None) -> torch.Tensor:
    """The last stage's tokens (and whether rows remain) on every stage, or its error raised on every stage."""
    link, last = engine.link, engine.num_stages - 1
    batch = state["unfinished"].shape[0]
    msg = torch.zeros(batch * 2 + 1, dtype=torch.long, device=link.device)
    if engine.is_last_stage():
        if error is not None:
            msg[-1] = -1
        else:
            msg[:batch], msg[batch:2 * batch], msg[-1] = tokens, state["unfinished"], 1
    link.p2p.broadcast(msg, src=last)
    if int(msg[-1]) == -1:  # one host read a step: the stop decision needs it anyway
        text = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8, device=link.device)
        if error is not None and engine.is_last_stage():
            raw = f"{type(error).__name__}\n{error}".encode()[:MESSAGE_BYTES]
            text[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8, device=link.device)
        link.p2p.broadcast(text, src=last)
        if error is not None:  # this stage's own error is the more precise line
            raise error
        kind, _, message = bytes(text.cpu().tolist()).rstrip(b"\0").decode(errors="replace").partition("\n")
        raise StageStopped(kind, message)
    if error is not None:
        raise error
    state["unfinished"] = msg[batch:2 * batch].to(state["unfinished"].device)
    return msg[:batch].to(state["unfinished"].device)


def _prompt(engine: Any, kwargs: dict) -> torch.Tensor:
    ids = kwargs.get("input_ids")
    if not torch.is_tensor(ids) or ids.dim() != 2 or ids.dtype != torch.long or ids.shape[1] == 0:
        raise UsageError("generate() on a pipeline needs input_ids, a [batch, length] tensor of token ids")
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool((mask == 1).all()):
        raise UsageError("generate() on a pipeline: a padded batch (attention_mask with zeros) is not served; "
                         "give prompts of one length")
    return ids.to(engine.device)


@torch.no_grad()
def generate(engine: Any, **kwargs: Any) -> torch.Tensor:
    """HF ``generate()`` through the stages (collective over the pipeline): the prompts followed by the
    generated tokens, ``[batch, length]``, on every stage."""
    from transformers.cache_utils import DynamicCache

    module = engine.module
    gen = _config(module, kwargs)
    ids = _prompt(engine, kwargs)
    total = ids.shape[1] + gen.max_new_tokens if gen.max_new_tokens is not None else gen.max_length
    processors = _processors(gen, kwargs.get("logits_processor"))
    state = {"eos": _eos(gen, ids.device), "unfinished": torch.ones(ids.shape[0], dtype=torch.long, device=ids.device)}
    cache, past, new = DynamicCache(config=module.hf_config), 0, ids
    was_training, held = module.training, getattr(engine, "fetcher", None) is not None
    module.eval()
    if held:  # ZeRO-3: the stage gathered once for the whole decode
        engine.fetcher.hold()
    try:
        while ids.shape[1] < total:
            tokens, error = None, None
            try:
                x = _through_chunks(engine, new, past, cache)
            except Exception as e:  # noqa: BLE001 - told downstream, then raised on every stage by _share
                error = e
                _stop_downstream(engine)
            if engine.is_last_stage() and error is None:
                try:
                    tokens = _pick(x, ids, gen, processors, state)
                except Exception as e:  # noqa: BLE001 - sent to every stage, then raised here too
                    error = e
            tokens = _share(engine, tokens, state, error)
            engine.link.drain()  # this step's sends are done (their hidden states may go)
            past, new = past + new.shape[1], tokens[:, None]
            ids = torch.cat([ids, new], dim=-1)
            if not bool(state["unfinished"].any()):
                break
    finally:
        if held:
            engine.fetcher.release_all()
        module.train(was_training)
    return ids
