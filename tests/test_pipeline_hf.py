"""A Hugging Face causal LM split by ``pipeline.stages`` without any rank materializing another stage's layers
(``shardwise.pipeline.stage_init``), and ``engine.generate`` decoded through the stages after a pipeline run
(tests/pipeline_hf_cases.py on the 2-rank pool)."""

from __future__ import annotations

import pipeline_hf_cases as phc
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
    assert ranks[0]["greedy_sent"] > 0  # stage 0's hidden states went to stage 1 through the counted Comm
    return trained


def test_stage_only_build_then_generate_through_the_stages(pool2) -> None:
    """From the config (seeded): each rank makes real only its stage's parameters (the other stage's stay on
    meta: the whole model's real bytes are the stage's), with the whole build's values bit for bit; after two
    training steps, greedy and seeded sampling decoded through the stages give HF generate()'s tokens on the
    unsplit model with the same weights. Cut into 2 x 2 virtual stages (interleaved 1F1B): the same trained
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
    _check(pool2.run("pipeline_hf_cases:stage_build_train_generate", True, folder), reference, True)
