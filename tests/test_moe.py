"""Expert parallelism (shardwise.moe): dispatch / combine, layouts, EP x ZeRO against one process.

Equivalence is measured in fp32 with SGD against the same model trained in one process on the same
global batch (the loss is the mean over the ranks' parts of each part's loss, aux loss included:
what data parallelism computes). The tolerance is K times a measured noise floor: the reference
trained again with transformers' other experts kernel (``eager`` instead of ``grouped_mm``: other
matmul shapes and summation order, the same math), and the test checks that the bound is far
below what doubled expert gradients do (the classic EP x ZeRO bug, pytorch #160285).
"""

from __future__ import annotations

import functools
import re

import moe_cases
import pytest
import torch
from tolerance import EPS32, K

STEPS = 3
CLIP = 1.0  # below the measured norms (~1.6-2.0): clipping is active, so the global norm must be right


# -- dispatch / combine (Megatron's dispatcher test) --------------------------------------
@pytest.mark.parametrize("experts,tokens,top_k", [(4, 7, 2), (8, 13, 3), (2, 5, 1)])
def test_dispatch_then_combine_restores_input_and_gradient(pool2, experts, tokens, top_k):
    for r in pool2.run("moe_cases:roundtrip", experts, tokens, top_k):
        assert r["rows"] == r["expected_rows"]
        assert r["equal"], r["max_err"]
        assert r["grad_equal"]


def test_a_rank_receiving_nothing_does_not_hang(pool2):
    # every token on both ranks goes to expert 1 (rank 0's): rank 1 receives no row
    res = pool2.run("moe_cases:roundtrip", 4, 5, 1, only_expert=1)
    assert res[1]["rows"] == 0 and res[0]["rows"] == 10
    assert all(r["equal"] and r["grad_equal"] for r in res)


def test_a_rank_with_no_tokens_does_not_hang(pool2):
    for tokens in ([0, 0], [6, 0]):  # rank 1 routes nothing (an empty micro-batch)
        res = pool2.run("moe_cases:roundtrip", 4, tokens, 2)
        assert all(r["equal"] and r["grad_equal"] and r["rows"] == r["expected_rows"] for r in res)


@pytest.mark.parametrize("experts", [4, 8])
def test_rows_arrive_grouped_by_local_expert(pool2, experts):
    assert all(r["grouped"] for r in pool2.run("moe_cases:sorted_rows", experts))


# -- layouts ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v2", "deepseek_v3",
                                  "gpt_oss"])
def test_forward_under_ep_equals_the_unsplit_model(pool2, kind):
    for r in pool2.run("moe_cases:forward_logits", kind, 2):
        assert r["logits_err"] <= 4 * EPS32 * r["logits_scale"], r
        assert r["loss"][0] == pytest.approx(r["loss"][1], rel=4 * EPS32)


def test_models_without_a_known_layout_are_refused():
    from tiny_models import build

    from shardwise.moe import UnsupportedMoEError, apply_expert_parallel

    with pytest.raises(UnsupportedMoEError, match="model_type 'llama'") as e:
        apply_expert_parallel(build("llama"), 1)
    assert "\n" not in str(e.value)
    with pytest.raises(UnsupportedMoEError, match="preset_model 'mixtral' does not match .*'qwen3_moe'"):
        apply_expert_parallel(moe_cases.build("qwen3_moe"), 1, preset="mixtral")
    with pytest.raises(UnsupportedMoEError, match="autoep_size 3 must divide the 4 experts"):
        apply_expert_parallel(moe_cases.build("mixtral"), 3)


# -- training: EP x ZeRO against one process -----------------------------------------------
def _max_abs(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@functools.cache
def _reference(kind: str, world: int, force: bool = False) -> dict:
    """The reference, its noise floor (the other experts kernel) and the bounds derived from it."""
    ref = moe_cases.reference(kind, world, STEPS, clip=CLIP, force=force)
    other = moe_cases.reference(kind, world, STEPS, clip=CLIP, force=force, implementation="eager")
    scale = max(float(w.abs().max()) for w in ref["weights"].values())
    floor = 32 * EPS32 * STEPS
    noise_w = _max_abs(other["weights"], ref["weights"])
    pairs = [(a, b) for x, y in zip(other["losses"], ref["losses"], strict=True) for a, b in zip(x, y, strict=True)]
    noise_l = max(abs(a - b) / abs(b) for a, b in pairs)
    ref["tol_w"] = max(K * noise_w, floor * scale)
    ref["tol_loss"] = max(K * noise_l, floor)
    ref["noise"] = (noise_w, noise_l)
    return ref


def _check(res: list[dict], ref: dict, world: int, ep: int, stage: int) -> None:
    for r in range(world):
        dp_rank = r  # every rank is a data-parallel rank: each trains its own part of the batch
        for got, want in zip(res[r]["losses"], [step[dp_rank] for step in ref["losses"]], strict=True):
            assert got == pytest.approx(want, rel=ref["tol_loss"]), (r, res[r]["losses"], ref["noise"])
        assert res[r]["norms"] == pytest.approx(ref["norms"], rel=ref["tol_loss"])
    diff = _max_abs(res[0]["weights"], ref["weights"])
    assert diff < ref["tol_w"], f"weights differ by {diff:.3g} (tol {ref['tol_w']:.3g}, noise {ref['noise']})"
    assert _max_abs(res[-1]["weights"], ref["weights"]) < ref["tol_w"]
    full = ref["expert_numel"] * 4
    for r in res:  # per-rank expert bytes are 1/EP of the experts' (1/world once ZeRO-3 shards over EDP too)
        assert r["expert_bytes"]["held"] == full // (world if stage == 3 else ep), (stage, r["expert_bytes"])


def test_the_tolerance_catches_doubled_expert_gradients():
    ref = _reference("mixtral", 2)
    # with the clipping every equivalence test runs with (it shrinks a doubled gradient's effect)
    doubled = moe_cases.reference("mixtral", 2, STEPS, clip=CLIP, expert_lr_factor=2.0)
    plain = moe_cases.reference("mixtral", 2, STEPS, clip=CLIP)
    assert _max_abs(doubled["weights"], plain["weights"]) > 10 * ref["tol_w"]


@pytest.mark.parametrize("kind,stage,use_config", [("mixtral", 2, False), ("mixtral", 3, True),
                                                   ("qwen3_moe", 2, True), ("qwen3_moe", 3, False),
                                                   ("mixtral", 0, False), ("qwen3_moe", 1, True),
                                                   ("gpt_oss", 2, False), ("gpt_oss", 3, True)])
def test_ep2_with_zero_matches_single_process(pool2, kind, stage, use_config):
    # use_config: through DeepSpeed AutoEP's keys in the config given to shardwise.initialize
    res = pool2.run("moe_cases:train_ep", kind, stage, 2, steps=STEPS, clip=CLIP, use_config=use_config)
    _check(res, _reference(kind, 2), 2, 2, stage)


@pytest.mark.parametrize("stage", [0, 2])
def test_ep2_times_dp2_on_four_ranks(pool4, stage):
    # EP groups {0,1} {2,3}; ranks 0 and 2 hold the same experts: their gradients meet over {0,2}
    # (stage 0: all-reduced, whole on both: the norm counts them once)
    res = pool4.run("moe_cases:train_ep", "mixtral", stage, 2, steps=STEPS, clip=CLIP)
    _check(res, _reference("mixtral", 4), 4, 2, stage)


def test_stage3_shards_experts_over_the_expert_data_parallel_group(pool4):
    res = pool4.run("moe_cases:train_ep", "qwen3_moe", 3, 2, steps=STEPS, clip=CLIP, use_config=True)
    _check(res, _reference("qwen3_moe", 4), 4, 2, 3)
    full = _reference("qwen3_moe", 4)["expert_numel"] * 4
    assert all(r["expert_bytes"]["held"] == full // 4 for r in res)  # 1/EP of the experts, then 1/EDP


@pytest.mark.parametrize("kind,section,extra,match", [
    ("llama", {"enabled": True, "autoep_size": 2}, None, "no known MoE layout for model_type 'llama'"),
    ("mixtral", {"enabled": True, "autoep_size": 2, "preset_model": "qwen3_moe"}, None,
     "preset_model 'qwen3_moe' does not match the model .model_type 'mixtral'"),
    ("mixtral", {"enabled": True, "autoep_size": 2, "comm_backend": "deepep"}, None, "DeepEP token exchange"),
    ("mixtral", {"enabled": True, "autoep_size": 2}, {"tensor_parallel": {"autotp_size": 2}, "train_batch_size": 1},
     "with tensor_parallel.autotp_size > 1 is not supported"),
    ("mixtral", {"enabled": True, "autoep_size": 3}, None, "autoep_size 3 must divide"),
])
def test_expert_parallel_config_refusals(pool2, kind, section, extra, match):
    for msg in pool2.run("moe_cases:refused_by_config", kind, section, extra):
        assert re.search(match, msg), msg
        assert "\n" not in msg


@pytest.mark.subprocess
def test_deepspeed_script_through_the_facade():
    # `deepspeed.initialize(config={"expert_parallel": ...})` with no DeepSpeed installed (own pool:
    # the facade stays installed in its processes)
    from rank_pool import run_fresh

    res = run_fresh(2, "moe_cases:train_ep", "mixtral", 3, 2, steps=STEPS, clip=CLIP, use_config=True,
                    facade=True, timeout_s=300)
    _check(res, _reference("mixtral", 2), 2, 2, 3)


def test_gradient_accumulation_under_ep(pool2):
    # 2 micro-batches of one sequence per rank and step; the reference averages the 4 parts' losses
    res = pool2.run("moe_cases:train_ep", "qwen3_moe", 2, 2, steps=STEPS, clip=CLIP, gas=2)
    ref = moe_cases.reference("qwen3_moe", 2, STEPS, clip=CLIP, gas=2)
    tol = _reference("qwen3_moe", 2)
    for r in range(2):
        for got, want in zip(res[r]["losses"], ref["losses"], strict=True):
            assert got == pytest.approx(want[2 * r:2 * r + 2], rel=tol["tol_loss"])
        assert res[r]["norms"] == pytest.approx(ref["norms"], rel=tol["tol_loss"])
    assert _max_abs(res[0]["weights"], ref["weights"]) < tol["tol_w"]


@pytest.mark.parametrize("dtype,bound", [("bf16", 0.15), ("fp16", 0.05)])
def test_low_precision_under_ep_stays_within_the_projects_bound(pool2, dtype, bound):
    # bf16 / fp16 compute (fp16: a static loss scale of 256), fp32 masters: the update (weights after -
    # before) within 15% / 5% of the fp32 one (the project's bounds, docs/architecture.md "Correctness");
    # the aux loss and clipping on
    res = pool2.run("moe_cases:train_ep", "mixtral", 3, 2, steps=STEPS, clip=CLIP, **{dtype: True})
    ref = _reference("mixtral", 2)
    init = dict(moe_cases.build("mixtral").named_parameters())
    upd = sum(float((ref["weights"][n] - init[n].detach()).square().sum()) for n in init) ** 0.5
    err = sum(float((res[0]["weights"][n].float() - ref["weights"][n]).square().sum()) for n in init) ** 0.5
    assert err < bound * upd, (dtype, err, upd)


def test_routing_onto_one_rank_neither_hangs_nor_differs(pool2):
    # every token picks experts 0 and 1, both on EP rank 0: rank 1's experts receive nothing
    res = pool2.run("moe_cases:train_ep", "mixtral", 3, 2, steps=STEPS, clip=CLIP, force=True)
    _check(res, _reference("mixtral", 2, force=True), 2, 2, 3)


# -- checkpoints and export -----------------------------------------------------------------
@pytest.mark.parametrize("kind,save,load", [("mixtral", (2, 2), (3, None)), ("mixtral", (3, None), (2, 2)),
                                           ("mixtral", (3, 2), (2, 1)), ("gpt_oss", (3, 2), (2, None))])
def test_checkpoint_saved_under_ep_loads_at_any_ep_degree(pool2, tmp_path, kind, save, load):
    """(stage, EP) when saving and when loading; EP None: none (experts ZeRO-sharded over every rank).
    The resumed run's next step equals the uninterrupted run's, and the weights it loaded are
    bit-exact; the checkpoint consolidates offline (`shardwise consolidate`, zero_to_fp32) into the
    full HF experts (gpt_oss: their biases too)."""
    from transformers import AutoModelForCausalLM

    from shardwise.checkpoint import consolidate
    from shardwise.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    tol = _reference(kind, 2)  # another stage / EP degree sums in another order: the measured floor
    ckpt = tmp_path / "ckpt"
    first = pool2.run("moe_cases:ckpt_run", kind, save[0], save[1], 2, save_dir=str(ckpt))
    straight = pool2.run("moe_cases:ckpt_run", kind, save[0], save[1], 3)
    resumed = pool2.run("moe_cases:ckpt_run", kind, load[0], load[1], 1, first=2, load_dir=str(ckpt))
    for r in range(2):
        assert resumed[r]["losses"] == pytest.approx(straight[r]["losses"][2:], rel=tol["tol_loss"])
    assert _max_abs(resumed[0]["weights"], straight[0]["weights"]) < tol["tol_w"]
    out = tmp_path / "hf"
    consolidate(str(ckpt), str(out))
    model = AutoModelForCausalLM.from_pretrained(out)
    fp32 = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), first[0]["weights"][n]), n
        assert torch.equal(fp32[n], first[0]["weights"][n]), n


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])  # gpt_oss: the expert biases gathered too
def test_save_16bit_model_under_ep_gives_the_full_hf_model(pool2, tmp_path, kind):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf16"
    res = pool2.run("moe_cases:ckpt_run", kind, 3, 2, 1, export_dir=str(out))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    assert model.config._experts_implementation != "shardwise_ep"
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), res[0]["weights"][n]), n
    ref = moe_cases.build(kind)
    ref.load_state_dict(res[0]["weights"])
    ids = moe_cases.batches(1, 1, 2)[0, 0]
    torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=4 * EPS32, atol=0)


# -- inference ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,stage", [("mixtral", 0), ("mixtral", 3), ("gpt_oss", 3)])
def test_generate_under_ep_gives_the_single_process_tokens(pool2, kind, stage):
    got = pool2.run("moe_cases:generate_ep", kind, stage, 2)
    assert got == moe_cases.generate_reference(kind, 2)


# -- shardwise train --ep -------------------------------------------------------------------
def test_shardwise_train_with_ep_matches_the_run_without(tmp_path, pool2, pool1):
    """`shardwise train --ep 2` on a Mixtral config at ZeRO-3: the same losses as without EP,
    checkpoints, the sample and the hf/ export included; a dense model is refused in one line naming
    its model type (exit 2). Every run goes through the CLI's entry in the rank pools (tests/train_cases.py;
    the refusal on the world of one); tests/test_cli_errors.py holds the real command's exit and one line."""
    from test_train_job import _args, _losses
    from train_cases import train_in

    cfg = moe_cases.moe_config("mixtral")
    cfg.vocab_size = 256  # the byte tokenizer's
    cfg.save_pretrained(tmp_path / "mixtral")
    model = str(tmp_path / "mixtral" / "config.json")
    ds = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
          "steps_per_print": 0, "optimizer": {"type": "SGD", "params": {"lr": 0.3}},
          "zero_optimization": {"stage": 3}}
    common = ("--model", model, "--steps", "4", "--eval-every", "0", "--save-every", "2", "--seq", "16")
    ep, plain = tmp_path / "ep", tmp_path / "plain"
    train_in(pool2, _args(tmp_path, ep, *common, "--ep", "2", "--sample-tokens", "4", ds=ds, export=True))
    # without EP at stage 2: a stage-3 `train` builds its model under zero.Init (another init order);
    # the EP run is built whole, and the stage does not change the numbers
    train_in(pool2, _args(tmp_path, plain, *common, ds={**ds, "zero_optimization": {"stage": 2}}))
    a, b = _losses(ep), _losses(plain)
    assert a.keys() == b.keys() and len(a) >= 4
    tol = _reference("mixtral", 2)["tol_loss"]  # EP sums in another order: the measured floor, not a CPU's
    for k in a:
        assert a[k] == pytest.approx(b[k], rel=tol), k
    assert (ep / "hf" / "config.json").is_file()
    ds1 = {**ds, "train_batch_size": 2}
    argv = _args(tmp_path, tmp_path / "dense", "--model", "llama-micro", "--steps", "1", "--ep", "1", ds=ds1)
    [(code, _, err)] = pool1.run("train_cases:train", argv, timeout=300)
    assert code == 2 and err.count("\n") == 1 and "model_type 'llama'" in err and "Traceback" not in err, err[-2000:]


@pytest.mark.subprocess
def test_hf_trainer_with_expert_parallel_config(tmp_path_factory):
    """The HF Trainer (`--deepspeed` config with `expert_parallel`, shardwise's facade, no DeepSpeed),
    at ZeRO-2 (model built first) and ZeRO-3 (model made by `from_pretrained` after the
    TrainingArguments, so under transformers' zero.Init): the same losses as the same Trainer run
    without EP, and `save_model` writes the full model: `from_pretrained` loads the trained engine's
    full weights bit for bit (logits equal), and the no-EP run's within the measured bound. The runs are
    tests/moe_trainer_job.py's part of the 2-rank launch this process shares (tests/facade_launch.py)."""
    import json

    import facade_launch
    from transformers import AutoModelForCausalLM

    tmp_path = facade_launch.part(tmp_path_factory, "moe")["root"]
    res = json.loads((tmp_path / "results.json").read_text())
    tol = _reference("mixtral", 2)
    ids = moe_cases.batches(1, 1, 2)[0, 0]
    for stage in (2, 3):
        ep, plain = res[f"ep{stage}"], res[f"plain{stage}"]
        assert ep["ep_size"] == 2 and ep["local_experts"] == 2 and plain["ep_size"] is None
        assert len(ep["losses"]) == 4 and ep["losses"].keys() == plain["losses"].keys()
        for k in ep["losses"]:
            assert ep["losses"][k] == pytest.approx(plain["losses"][k], rel=tol["tol_loss"]), (stage, k)
        saved = {}
        for run in (f"ep{stage}", f"plain{stage}"):
            model = AutoModelForCausalLM.from_pretrained(tmp_path / run / "model", dtype=torch.float32,
                                                         attn_implementation="eager")
            live = torch.load(tmp_path / run / "live.pt")
            weights = {n: p.detach() for n, p in model.named_parameters()}
            assert weights.keys() == live.keys()
            for n, w in weights.items():
                assert torch.equal(w, live[n]), (run, n)
            saved[run] = (weights, model(input_ids=ids).logits.detach())
        (w_ep, l_ep), (w_plain, l_plain) = saved[f"ep{stage}"], saved[f"plain{stage}"]
        assert _max_abs(w_ep, w_plain) < tol["tol_w"], stage
        assert float((l_ep - l_plain).abs().max()) <= tol["tol_loss"] * float(l_plain.abs().max()), stage


# -- sequence parallelism x expert parallelism ------------------------------------------------
@functools.cache
def _reference_sp(kind: str, dp: int = 1) -> dict:
    """SP x EP's reference (the whole batch in one process, no SP: the model's own loss, its aux loss over
    the whole batch; ``dp`` replicas: the mean of their parts' losses) and its bounds: K times its noise
    floor (trained again with the `eager` experts kernel), never below 32 ulps per step."""
    ref = moe_cases.reference_sp(kind, STEPS, clip=CLIP, dp=dp)
    other = moe_cases.reference_sp(kind, STEPS, clip=CLIP, implementation="eager", dp=dp)
    scale = max(float(w.abs().max()) for w in ref["weights"].values())
    floor = 32 * EPS32 * STEPS
    ref["tol_w"] = max(K * _max_abs(other["weights"], ref["weights"]), floor * scale)
    pairs = [(a, b) for x, y in zip(other["parts"], ref["parts"], strict=True) for a, b in zip(x, y, strict=True)]
    ref["tol_loss"] = max(K * max(abs(a - b) / abs(b) for a, b in pairs), floor)
    return ref


@pytest.mark.parametrize("stage,train_loop", [(2, False), (3, True)])
def test_sp2_with_ep2_on_the_same_ranks_matches_single_process(pool2, stage, train_loop):
    """Ulysses SP 2 and EP 2 on the same 2 ranks (Qwen3-MoE, sdpa, aux loss on at coefficient 0.1): both
    ranks hold halves of the same sequences and halves of the experts. Dense gradients (each SP rank
    back-propagates N times its share) and expert gradients (summed over the ranks whose tokens reached
    the expert by the all-to-all's backward) are both divided by the same SP x DP rank count, and the
    aux loss is the whole sequence's (`router_aux_loss`: the router logits gathered over the SP ranks),
    so losses, gradient norms and weights equal the model's own no-SP training on the whole batch.
    The mean of the shards' aux losses (the objective before) misses it by 1.1e-3 in the weights.
    `train_loop`: through `shardwise train`'s loss (train.loop.micro_loss)."""
    ref = _reference_sp("qwen3_moe")
    res = pool2.run("moe_cases:train_sp_ep", "qwen3_moe", stage, 2, 2, steps=STEPS, clip=CLIP, train_loop=train_loop)
    for r in range(2):
        assert res[r]["sp_rank"] == r and res[r]["dp_world"] == 1
        assert res[r]["losses"] == pytest.approx(ref["losses"], rel=ref["tol_loss"])
        assert res[r]["norms"] == pytest.approx(ref["norms"], rel=ref["tol_loss"])
        diff = _max_abs(res[r]["weights"], ref["weights"])
        assert diff < ref["tol_w"], f"weights differ by {diff:.3g} (tol {ref['tol_w']:.3g})"


def test_sp2_x_ep2_x_dp2_on_four_ranks_at_zero3(pool4):
    """SP 2 x DP 2 on 4 ranks (SP groups [0, 1] and [2, 3]) with EP 2 at ZeRO-3 (experts sharded over the
    expert-data-parallel group too): each SP group trains its replica's sequences, and losses (per
    replica), gradient norms and weights equal one process training both replicas' parts, each part
    with the model's own loss and its aux loss over that part's whole sequences."""
    ref = _reference_sp("qwen3_moe", dp=2)
    res = pool4.run("moe_cases:train_sp_ep", "qwen3_moe", 3, 2, 2, steps=STEPS, clip=CLIP)
    assert sorted((r["dp_rank"], r["sp_rank"]) for r in res) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in res:
        assert r["dp_world"] == 2
        assert r["losses"] == pytest.approx([p[r["dp_rank"]] for p in ref["parts"]], rel=ref["tol_loss"])
        assert r["norms"] == pytest.approx(ref["norms"], rel=ref["tol_loss"])
        diff = _max_abs(r["weights"], ref["weights"])
        assert diff < ref["tol_w"], f"weights differ by {diff:.3g} (tol {ref['tol_w']:.3g})"


def test_sp_aux_loss_is_the_whole_sequences_with_padding(pool2):
    """SP 2, one forward + backward, 13 tokens (the tail `split_batch` pads) and the last sample right
    padded from 7 (the shards carry no attention mask): `router_aux_loss` gives the no-SP model's own
    aux loss over the whole batch, pads left out as its attention_mask leaves them, and with the token
    loss the no-SP loss and gradients. Bound: 32 fp32 ulps (one step of tolerance.py's floor); measured
    1.5e-8 (aux), 1.2e-7 (gradients). The mean of the shards' own aux losses misses the aux by 2.2e-3,
    leaving the pads in by 2.5e-3 (gradients 0.54): the bound tells them apart."""
    bound = 32 * EPS32
    for r in pool2.run("moe_cases:sp_aux_matches_whole", "qwen3_moe", 13, 7):
        assert r["loss"] < bound and r["aux"] < bound and r["grad"] < bound, r
        assert r["mean_of_shards_aux"] > 100 * bound, r
