"""Continuing DeepSpeed and FSDP2/DCP runs on shardwise from their own checkpoint files.

The fixtures in ``tests/data/foreign_ckpt/`` were written once by DeepSpeed 0.19.8 and by FSDP2 +
DCP (torch 2.13) with ``make_fixtures.py``, which also recorded the losses and final weights of
each library's uninterrupted run. This suite runs without DeepSpeed.

Tolerances. Losses: 1e-4 relative (the issue's bound), far above the round-off of two more steps
(measured on this machine: every same-layout resume, fp32 and bf16, gives the writer's losses
bit for bit; world 2 -> 1 gives plain PyTorch's within 1.2e-7) and far below what a wrong load
does (dropping the Adam moments moves the next loss by 8.7e-4; ``test_dropping_state_is_detected``).
Final fp32 weights: ``tolerance.py``'s floor of 32 fp32 ulps per step (1.5e-5 after the 4 steps,
for weights of magnitude <= 1; measured 5e-10 .. 3e-8), since another CPU's kernels round
differently from the one that recorded the fixtures; bf16 runs: 2e-3 (a quarter of a bf16 ulp at
1.0: another CPU may flip one bf16 rounding of the forward; measured 0). Dropping the moments or
the scheduler position moves the final weights by 2e-2 / 6e-3.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from foreign_ckpt_model import FROZEN, SAVE_AT, STEPS, batch, build
from safetensors.torch import load_file
from tolerance import EPS32, ULPS_PER_STEP

from shardwise.checkpoint import CheckpointError, consolidate
from shardwise.checkpoint.formats import open_checkpoint

FIXTURES = Path(__file__).parent / "data" / "foreign_ckpt"
RECORD = json.loads((FIXTURES / "losses.json").read_text())
LOSS_TOL = 1e-4  # relative; see the module docstring
WEIGHT_TOL = {False: ULPS_PER_STEP * EPS32 * STEPS, True: 2e-3}  # fp32 / bf16 run, abs; see the docstring

CASES = {  # fixture: (stage, bf16, frozen parameter, scheduler)
    "ds_z1": (1, False, False, True), "ds_z2_frozen": (2, False, True, True), "ds_z2_bf16": (2, True, False, True),
    "ds_z3_frozen": (3, False, True, True), "ds_z3_bf16": (3, True, False, True),
    "fsdp2_dcp": (2, False, False, False)}


def rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _check_weights(got: dict, case: str, bf16: bool) -> None:
    want = load_file(str(FIXTURES / case / "final.safetensors"))
    assert set(want) <= set(got)
    worst = max((got[n] - w).abs().max().item() for n, w in want.items())
    print(f"[measured] {case}: final weights max abs diff {worst:.2e}")
    assert worst < WEIGHT_TOL[bf16], (case, worst)


@pytest.mark.parametrize("case", list(CASES))
def test_continue_same_layout(pool2, case):
    """World 2 at the writer's stage: the writing library's own uninterrupted run, rank by rank."""
    stage, bf16, frozen, sched = CASES[case]
    res = pool2.run("foreign_ckpt_cases:continue_from", case, stage, bf16, frozen, sched)
    for r in range(2):
        assert res[r]["start"] == SAVE_AT and res[r]["end"] == STEPS
        diff = rel(res[r]["losses"], RECORD["runs"][case][r][SAVE_AT:])
        print(f"[measured] {case} rank {r}: losses rel diff {diff:.1e}")
        assert diff < LOSS_TOL, (case, r)
    if case.startswith("ds_"):
        assert res[0]["client"] == {"epoch": 3, "note": "halfway"}
    _check_weights(res[0]["weights"], case, bf16)
    if frozen:  # never trained: exactly the saved (initial) value
        assert torch.equal(res[0]["weights"][FROZEN], build(frozen=True).get_parameter(FROZEN).detach())


@pytest.mark.parametrize("case,stage", [("ds_z2_frozen", 3), ("ds_z3_frozen", 1), ("fsdp2_dcp", 3)])
def test_continue_resharded_world1(case, stage):
    """World 2 -> 1 (and another stage): plain single-process PyTorch's losses on the whole batch."""
    from foreign_ckpt_cases import continue_from

    _, bf16, frozen, sched = CASES[case]
    res = _world1(continue_from, case, stage, bf16, frozen, sched)
    ref = RECORD["reference"]["warmup_frozen" if frozen else "warmup"] if sched else RECORD["reference"]["constant"]
    print(f"[measured] {case} -> world 1 stage {stage}: losses rel diff {rel(res['losses'], ref[SAVE_AT:]):.1e}")
    assert rel(res["losses"], ref[SAVE_AT:]) < LOSS_TOL, (res["losses"], ref[SAVE_AT:])
    _check_weights(res["weights"], case, bf16)


def _world1(target, *args, **kw):
    import torch.distributed as dist
    from ckpt_cases import world1_group

    created = world1_group()
    try:
        return target(*args, **kw)
    finally:
        if created:
            dist.destroy_process_group()


def test_dropping_state_is_detected():
    """The tolerance can see a wrong load: without the Adam moments, or without the scheduler's
    position, the continued losses leave DeepSpeed's by far more than LOSS_TOL."""
    from foreign_ckpt_cases import continue_from

    ref = RECORD["reference"]["warmup_frozen"][SAVE_AT:]
    want = load_file(str(FIXTURES / "ds_z2_frozen" / "final.safetensors"))
    for kw, loss_off in (({"load_optimizer_states": False}, 5 * LOSS_TOL), ({"load_lr_scheduler_states": False}, 0)):
        res = _world1(continue_from, "ds_z2_frozen", 2, False, True, True, **kw)
        worst = max((res["weights"][n] - w).abs().max().item() for n, w in want.items())
        print(kw, rel(res["losses"], ref), worst)
        assert rel(res["losses"], ref) >= loss_off and worst > 100 * WEIGHT_TOL[False], (kw, res["losses"], worst)


def test_hf_trainer_checkpoint():
    """The HF Trainer's checkpoint-N/ (DeepSpeed ZeRO-2 inside): the masters are the weights the
    Trainer saved beside them (model.safetensors, fp32), exactly; consolidate finds its config.json."""
    from foreign_ckpt_cases import trainer_checkpoint

    ckpt = FIXTURES / "hf_trainer_z2" / "checkpoint-2"
    res = _world1(trainer_checkpoint, 3)
    want = load_file(str(ckpt / "model.safetensors"))
    assert res["steps"] == json.loads((ckpt / "trainer_state.json").read_text())["global_step"] == SAVE_AT
    assert all(torch.equal(res["masters"][n], w) for n, w in want.items())


def test_deepspeed_zero_to_fp32_api_reads_deepspeed_files():
    """``shardwise.utils.zero_to_fp32`` (DeepSpeed's helper names) on DeepSpeed's own checkpoint."""
    from shardwise.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ckpt = FIXTURES / "hf_trainer_z2" / "checkpoint-2"
    got = get_fp32_state_dict_from_zero_checkpoint(ckpt)
    want = load_file(str(ckpt / "model.safetensors"))
    assert set(got) == set(want) and all(torch.equal(got[n], w) for n, w in want.items())


def test_consolidate_cli_and_optimizer_mismatch(tmp_path, capsys):
    from foreign_ckpt_cases import load_error

    from shardwise.cli.consolidate import main as consolidate_main

    ckpt = FIXTURES / "hf_trainer_z2" / "checkpoint-2"
    assert consolidate_main([str(ckpt), str(tmp_path / "hf")]) == 0  # config.json from checkpoint-2/
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    want = load_file(str(ckpt / "model.safetensors"))
    assert all(torch.equal(model.get_parameter(n).detach(), w) for n, w in want.items())
    msg = _world1(load_error, str(FIXTURES / "ds_z1"), sgd=True)
    assert "keeps ['exp_avg', 'exp_avg_sq'] per element, this engine's SGD keeps ['momentum_buffer']" in msg
    assert msg.endswith("unchanged=True")


def test_fsdp_style_api_continues_dcp():
    """``shardwise.load_checkpoint(dir, model, optimizer)`` reads the FSDP2 checkpoint too."""
    from foreign_ckpt_cases import fsdp_api_continue

    losses = _world1(fsdp_api_continue, "fsdp2_dcp", 2)
    assert rel(losses, RECORD["reference"]["constant"][SAVE_AT:]) < LOSS_TOL, losses


def test_continue_stage2_to_stage3(pool2):
    """A ZeRO-2 DeepSpeed checkpoint continued at stage 3 on 2 ranks: DeepSpeed's run."""
    res = pool2.run("foreign_ckpt_cases:continue_from", "ds_z2_frozen", 3, False, True, True)
    for r in range(2):
        assert rel(res[r]["losses"], RECORD["runs"]["ds_z2_frozen"][r][SAVE_AT:]) < LOSS_TOL
    _check_weights(res[0]["weights"], "ds_z2_frozen", False)


@pytest.mark.parametrize("case", ["ds_z3_frozen", "ds_z2_bf16", "fsdp2_dcp"])
def test_consolidate(tmp_path, case):
    """``consolidate`` writes the saved fp32 weights; plain transformers gives the recorded loss."""
    consolidate(FIXTURES / case, tmp_path / "hf", weights_only=True)
    model = build(seed=5, frozen=case.endswith("frozen"))
    sd = load_file(str(tmp_path / "hf" / "model.safetensors"))
    model.load_state_dict(sd, strict=True)
    ids = batch(SAVE_AT, 0, 1)
    with torch.no_grad():
        loss = float(model(input_ids=ids, labels=ids).loss)
    want = sum(RECORD["runs"][case][r][SAVE_AT] for r in range(2)) / 2  # equal-length sequences: the mean
    assert abs(loss - want) / want < LOSS_TOL


# -- refused --------------------------------------------------------------------------------------------
def _copy(case: str, tmp_path: Path) -> Path:
    dst = tmp_path / case
    shutil.copytree(FIXTURES / case, dst)
    return dst


class _RunsCommand:
    """Unpickling this would run a shell command that creates ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_that_runs_code_is_refused(tmp_path):
    ckpt = _copy("ds_z1", tmp_path)
    marker = tmp_path / "PWNED"
    target = ckpt / "global_step2" / "mp_rank_00_model_states.pt"
    torch.save({"module": {}, "buffer_names": [], "evil": _RunsCommand(marker)}, target)
    with pytest.raises(CheckpointError, match=r"mp_rank_00_model_states\.pt: refused to unpickle: global "
                                              r"'posix\.system'"):
        open_checkpoint(ckpt / "global_step2")
    assert not marker.exists()


def test_pickle_that_imports_a_module_is_refused(tmp_path):
    ckpt = _copy("fsdp2_dcp", tmp_path)
    (ckpt / ".metadata").write_bytes(pickle.dumps({"x": shutil.rmtree}))
    with pytest.raises(CheckpointError, match=r"\.metadata: refused to unpickle: global 'shutil\.rmtree'"):
        open_checkpoint(ckpt)


def test_tensor_shorter_than_its_storage_is_refused(tmp_path):
    class Short:
        def __reduce__(self):
            import collections

            storage = torch.zeros(4).untyped_storage()
            return (torch._utils._rebuild_tensor_v2,
                    (torch.storage.TypedStorage(wrap_storage=storage, dtype=torch.float32, _internal=True), 0,
                     (1000,), (1,), False, collections.OrderedDict()))

    ckpt = _copy("ds_z1", tmp_path)
    f = ckpt / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"zero_stage": 1, "t": Short()}}, f)
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_1_mp_rank_00_optim_states\.pt: not a readable torch"):
        open_checkpoint(ckpt / "global_step2")


@pytest.mark.parametrize("latest", ["../outside", "/etc", "global_step2/../../outside"])
def test_latest_leaving_the_folder_is_refused(tmp_path, latest):
    from shardwise.checkpoint.load import resolve_tag

    ckpt = _copy("ds_z1", tmp_path)
    shutil.copytree(ckpt / "global_step2", tmp_path / "outside")
    (ckpt / "latest").write_text(latest)
    with pytest.raises(CheckpointError, match="latest"):
        resolve_tag(ckpt, None)


def test_file_outside_the_folder_is_not_read(tmp_path):
    """A rank file that is a symlink out of the folder, and a DCP item naming a file outside it."""
    ckpt = _copy("ds_z1", tmp_path)
    f = ckpt / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shutil.move(f, tmp_path / "elsewhere.pt")
    f.symlink_to(tmp_path / "elsewhere.pt")
    with pytest.raises(CheckpointError, match="outside"):
        open_checkpoint(ckpt / "global_step2")
    dcp = _copy("fsdp2_dcp", tmp_path)
    shutil.copy(dcp / "__0_0.distcp", tmp_path / "__0_0.distcp")
    raw = (dcp / ".metadata").read_bytes().replace(b"\x8c\x0c__0_0.distcp", b"\x8c\x0c../0_0.distcp")
    (dcp / ".metadata").write_bytes(raw)
    with pytest.raises(CheckpointError, match="outside"):
        open_checkpoint(dcp)


@pytest.mark.parametrize("extra,match", [
    ("expp_rank_0_mp_rank_00_optim_states.pt", "MoE expert"),
    ("layer_0_expert_0_mp_rank_00_model_states.pt", "MoE expert"),
    ("mp_rank_01_model_states.pt", "tensor-parallel"),
])
def test_unsupported_layouts_are_refused_by_name(tmp_path, extra, match):
    ckpt = _copy("ds_z2_frozen", tmp_path)
    (ckpt / "global_step2" / extra).write_bytes(b"")
    with pytest.raises(CheckpointError, match=f"{extra}.*{match}".replace(".", r"\.").replace(r"\.*", ".*")):
        open_checkpoint(ckpt / "global_step2")


def test_missing_rank_file_is_refused(tmp_path):
    ckpt = _copy("ds_z3_frozen", tmp_path)
    (ckpt / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    (ckpt / "global_step2" / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    (ckpt / "global_step2" / "zero_pp_rank_2_mp_rank_00_optim_states.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"ranks \[0, 2\]"):
        open_checkpoint(ckpt / "global_step2")


def test_failed_load_is_collective_and_changes_nothing(pool2, tmp_path):
    ckpt = _copy("ds_z2_frozen", tmp_path)
    f = ckpt / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    f.write_bytes(f.read_bytes()[:-200])  # truncated
    msgs = pool2.run("foreign_ckpt_cases:load_error", str(ckpt))
    assert msgs[0] == msgs[1] and "zero_pp_rank_1_mp_rank_00_optim_states.pt" in msgs[0], msgs
    assert msgs[0].endswith("unchanged=True")
