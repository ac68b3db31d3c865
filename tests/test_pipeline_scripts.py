"""Pipeline scripts as users write them (tests/pipeline_script_cases.py): DeepSpeed's CIFAR example's shape, a
Hugging Face causal LM split by ``pipeline.stages``, bad input refused in one line, a stage that dies."""

from __future__ import annotations

import pipeline_script_cases as psc
import pytest
import torch


@pytest.mark.parametrize(("kind", "words"), [
    ("stages", "2 stages but only 1 layers"),
    ("batch", "train_batch_size"),
    ("tied_shapes", "TiedLayerSpec 'p': the tied weights have shapes"),
    ("fp16", "fp16.enabled"),
    ("interleaved_v1", "interleaved_1f1b needs virtual_stages > 1"),
    ("virtual_1f1b", "virtual_stages > 1 needs interleaved_1f1b"),
])
def test_bad_input_is_one_line_on_every_rank(pool2, kind: str, words: str) -> None:
    for line in pool2.run("pipeline_script_cases:refusal", kind):
        assert words in line and "\n" not in line, line


def test_a_tied_tensor_its_first_use_leaves_alone_is_refused(pool2) -> None:
    """A tied bias that only the last use reads: its gradient would have nowhere to go on the owner (stage 0),
    which says so in one line and stops; stage 1, waiting for the weights, ends naming stage 0."""
    owner, copy = pool2.run("pipeline_script_cases:refusal", "tied_unused")
    assert "TiedLayerSpec ['p']" in owner and "first use must use every tied_weight_attr" in owner, owner
    assert "StageTransferError" in copy and "stage 0 stopped" in copy and "\n" not in owner + copy, copy


def test_a_stage_output_that_is_no_tensor_ends_both_stages(tmp_path) -> None:
    """Stage 0 refuses its dict output in one line; stage 1, waiting for it, ends at once naming stage 0."""
    from rank_pool import run_fresh

    first, second = run_fresh(2, "pipeline_script_cases:refusal", "output", timeout_s=60)
    assert "pipeline stage 0's output must be a tensor or a tuple" in first and "dict" in first, first
    assert "StageTransferError" in second and "from stage 0 (rank 0)" in second and "stopped" in second, second


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tie_word_embeddings"])
def test_hf_causal_lm_split_by_pipeline_stages(pool2, tied: bool) -> None:
    """deepspeed.initialize(model=llama, config={"pipeline": {"stages": 2}}): embedding first, the decoder
    layers cut uniformly, norm and head last (the embedding's weight again when tied); HF's own losses."""
    ref = psc.lm_reference(dp=1, tied=tied)
    for losses in pool2.run("pipeline_script_cases:train_lm", 2, tied):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=0)


def test_a_stage_that_dies_ends_its_neighbour_with_one_line(tmp_path) -> None:
    """Stage 1's process exits mid-batch: stage 0, waiting for a gradient, ends long before the timeout
    with one line naming the stage, its rank and the transfer."""
    from rank_pool import RankError, run_fresh

    with pytest.raises(RankError):
        run_fresh(2, "pipeline_script_cases:dead_stage", str(tmp_path), timeout_s=60, timeout=8)  # rank 1 never answers
    seconds, line = (tmp_path / "rank0.txt").read_text().split("\n", 1)
    assert "StageTransferError: pipeline stage 0 (rank 0) failed receiving" in line, line
    assert "from stage 1 (rank 1)" in line and "\n" not in line, line
    assert float(seconds) < 30, seconds


def test_deepspeeds_cifar_example_shape(pool2, tmp_path) -> None:
    """A script shaped as DeepSpeed's CIFAR pipeline example (args.deepspeed_config, plain modules and a
    lambda, training_data, train_batch() without an iterator, its loader repeating): the single-process losses;
    rank 0 (stage 0, which computes no loss) prints the batch's loss every steps_per_print steps, as DeepSpeed."""
    folder = tmp_path / "run"
    folder.mkdir()
    ref = psc.cifar_reference()
    (losses, lines), (losses1, lines1) = pool2.run("pipeline_script_cases:cifar_script", str(folder))
    for got in (losses, losses1):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=0)
    assert len(lines) == 2 and lines1 == [], (lines, lines1)
    for line, step in zip(lines, (2, 4), strict=True):
        assert line.startswith(f"[shardwise] step {step}: loss {losses[step - 1]:.4f} |"), line
