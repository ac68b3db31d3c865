"""A Hugging Face causal LM split by ``pipeline.stages`` without any rank materializing another stage's layers
(``shardwise.pipeline.stage_init``), and ``engine.generate`` decoded through the stages after a pipeline run
(tests/pipeline_hf_cases.py on the 2-rank pool)."""

from __future__ import annotations

import pipeline_hf_cases as phc
import pytest
import torch
from pipeline_script_cases import tiny_lm


def _whole_with(trained: dict, tied: bool):
    """The unsplit model holding the stages' trained weights (HF's own generate runs on it)."""
    model = tiny_lm(tied).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(trained[name])
    return model


def _check(ranks: list[dict], reference, tied: bool) -> dict:
    """Each rank made real its stage's parameters only, with the whole build's values; the decode through the
    stages gave HF generate()'s tokens on the unsplit model holding the stages' trained weights."""
    whole = dict(reference.named_parameters())
    total = sum(p.numel() * p.element_size() for p in reference.parameters())
    trained: dict = {}
    for r in ranks:
        assert r["metas_before"] == len(whole) and r["whole_real"] == r["stage_bytes"] == r["made"], r["stage"]
        assert 0 < r["stage_bytes"] < total
        for name, t in r["initial"].items():
            assert torch.equal(t, whole[name].detach()), name
        trained.update(r["trained"])
    assert sorted(trained) == sorted(whole)
    model = _whole_with(trained, tied)
    ids = phc.prompt()
    greedy = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=phc.NEW_TOKENS,
                            do_sample=False)
    torch.manual_seed(phc.SAMPLE_SEED)
    sampled = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=phc.NEW_TOKENS,
                             do_sample=True, top_k=10, temperature=0.8)
    for r in ranks:
        assert torch.equal(r["greedy"], greedy) and torch.equal(r["sampled"], sampled), (r["greedy"], greedy)
        assert "num_beams not served" in r["beams"] and "\n" not in r["beams"], r["beams"]
        assert "was split into pipeline stages by initialize" in r["whole_call"], r["whole_call"]
    assert ranks[0]["greedy_sent"] > 0  # stage 0's hidden states went to stage 1 through the counted Comm
    return trained


def test_stage_only_build_then_generate_through_the_stages(pool2) -> None:
    """From the config (seeded): each rank makes real only its stage's parameters (the other stage's stay on
    meta: the whole model's real bytes are the stage's), with the whole build's values bit for bit; after two
    training steps, greedy and seeded sampling decoded through the stages give HF generate()'s tokens on the
    unsplit model with the same weights; the model given to initialize refuses a call of its own (its other
    stage's layers are not here). Cut into 2 x 2 virtual stages (interleaved 1F1B): the same trained
    weights bit for bit, the decode going round the ranks twice a token."""
    reference = tiny_lm(False)
    plain = _check(pool2.run("pipeline_hf_cases:stage_build_train_generate", False), reference, False)
    virtual = _check(pool2.run("pipeline_hf_cases:stage_build_train_generate", False, None, 2), reference, False)
    for name, t in plain.items():
        assert torch.equal(virtual[name], t), name


def test_tied_model_from_a_folder_read_by_stage(pool2, tmp_path) -> None:
    """Read from a save_pretrained folder (tie_word_embeddings): each rank reads its stage's tensors only (the
    last stage the embedding again, for its tied head), equal to the folder's; the decode as above."""
    reference = tiny_lm(True)
    folder = str(tmp_path / "folder")
    reference.save_pretrained(folder)
    ranks = pool2.run("pipeline_hf_cases:stage_build_train_generate", True, folder)
    _check(ranks, reference, True)
    for r in ranks:  # the folder's bytes read are the stage's tensors' (fp32 stored, fp32 built), no more
        assert r["read"] == r["stage_bytes"], (r["stage"], r["read"], r["stage_bytes"])


def _llama(**extra):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32, **extra)
    return AutoModelForCausalLM.from_config(cfg)


def test_stage_init_replays_inits_through_views_and_keeps_the_generator_in_step() -> None:
    """In one process: an embedding with a padding row (zeroed through a view of the weight), every parameter
    made real afterwards equals the whole build's, and the generator is where the whole build left it."""
    from shardwise.pipeline import materialize_stage, stage_init

    torch.manual_seed(3)
    whole, after_whole = _llama(pad_token_id=5), torch.rand(4)
    torch.manual_seed(3)
    with stage_init():
        model = _llama(pad_token_id=5)
    assert torch.equal(torch.rand(4), after_whole)
    assert all(p.is_meta for p in model.parameters())
    made = materialize_stage(model.model.layers[1], model)  # one layer: the rest stays on meta
    assert made == sum(p.numel() * p.element_size() for p in whole.model.layers[1].parameters())
    assert model.model.embed_tokens.weight.is_meta
    materialize_stage(model, model)
    for (name, a), b in zip(whole.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert not bool(model.model.embed_tokens.weight[5].any())


class _CustomInits(torch.nn.Module):
    """Inits a model's own code may write: through ``.data``, a transposed (non-contiguous) view, item
    assignment and an in-place operator."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 6)
        self.extra = torch.nn.Parameter(torch.empty(4, 3))
        with torch.no_grad():
            self.fc.weight.data.normal_(0, 0.5)
            self.extra.data.T.uniform_(-1, 1)
            self.fc.weight[1] = 3.0
            self.fc.weight *= 2
            self.fc.bias.data[0:2] = 5.0


def test_stage_init_replays_a_modules_own_inits() -> None:
    from shardwise.pipeline import materialize_stage, stage_init

    torch.manual_seed(2)
    whole = _CustomInits()
    torch.manual_seed(2)
    with stage_init():
        model = _CustomInits()
    materialize_stage(model, model)
    for (name, a), b in zip(whole.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_stage_init_refusals_are_one_line(tmp_path) -> None:
    """A meta model not built under stage_init (zero.Init from a config: nothing recorded), and a folder whose
    tensors do not have the config's shapes (refused before reading, naming the file and the tensor)."""
    from transformers import AutoModelForCausalLM

    import shardwise
    from shardwise.errors import UsageError
    from shardwise.pipeline import materialize_stage, stage_init

    with shardwise.zero.Init():
        bare = _llama()
    with pytest.raises(UsageError, match="not built under shardwise.pipeline.stage_init") as e:
        materialize_stage(bare.model.layers[0], bare)
    assert "\n" not in str(e.value)
    _llama().save_pretrained(tmp_path)
    config = (tmp_path / "config.json").read_text().replace('"intermediate_size": 48', '"intermediate_size": 40')
    (tmp_path / "config.json").write_text(config)
    with stage_init():
        model = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="mlp.gate_proj.weight' is stored with shape \\[48, 32\\]") as e:
        materialize_stage(model.model.layers[0], model)
    assert "model.safetensors" in str(e.value) and "\n" not in str(e.value)


def test_a_stage_failing_in_the_decode_ends_every_stage(pool2) -> None:
    """Stage 0's layers raise at the second token: stage 0 ends with its own error, stage 1 (waiting for its
    hidden states) at once with one line naming stage 0 (not at the timeout)."""
    (first, t0), (second, t1) = pool2.run("pipeline_hf_cases:failing_decode")
    assert first == "RuntimeError: a layer failed at the second step", first
    assert second.startswith("StageTransferError: pipeline stage 1 (rank 1) failed receiving the decode's hidden")
    assert "stage 0 stopped with an error of its own" in second and "\n" not in second, second
    assert max(t0, t1) < 10, (t0, t1)
