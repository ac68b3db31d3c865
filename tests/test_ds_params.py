"""DeepSpeed's ZeRO-3 parameter surface as TRL reads and drives it (shardwise/deepspeed/params.py),
on 2 gloo ranks: ``ds_status`` true for the live state, ``ds_external_parameters()``, and the
``optimizer.parameter_offload`` hooks that ``trl.models.unwrap_model_for_generation`` removes
and re-adds around ``generate()``."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import ds_params_cases as cases  # noqa: E402


def test_ds_status_is_live(pool2):
    for seen in pool2.run("ds_params_cases:status_follows_the_live_state"):
        assert seen["in_forward"] == "AVAILABLE" and seen["active_has_layer"]
        assert seen["after"] == "NOT_AVAILABLE" and seen["active_after"] == 0
        assert seen["gathered"] == "AVAILABLE" and seen["is_parameter"]
        assert seen["external_root"] == []  # a Llama reads no parameter of another unit
        assert seen["external_registered"] == [True]  # register_external_parameter's, as DeepSpeed's


def test_trl_remove_and_add_hooks_around_generate(pool2):
    ref = cases.plain_reference()
    res = pool2.run("ds_params_cases:trl_generation_hooks")
    for r in res:
        assert r["tokens"] == ref["tokens"]  # greedy decoding with the whole model, as one process
        assert r["gathered"] > 0 and r["gen_bytes"] == 0  # gathered once, nothing per token
        assert r["after"] == "NOT_AVAILABLE"  # hooks live again: released after the block
    # two ranks' halves averaged vs one batch: fp32 round-off only (docs/architecture.md, Correctness)
    for step, want in enumerate(ref["losses"]):
        got = (res[0]["losses"][step] + res[1]["losses"][step]) / 2  # each rank's loss is its half's mean
        assert abs(got - want) <= 1e-5 * abs(want), step


def test_a_forward_with_hooks_left_removed_is_refused(pool2):
    for msg in pool2.run("ds_params_cases:hooks_left_removed_is_refused"):
        assert "_register_deepspeed_module" in msg
