"""Every DeepSpeed key is known; hostile config files give one clear ConfigError (issues 10 and 11)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.config import ConfigError, ShardwiseConfig, SupportedFeatures, load_config, timeout_of
from shardwise.config.keys import BY_PATH, KEYS, markdown
from shardwise.config.triage import check_table_covers_schema

DATA = Path(__file__).parent / "data"
ALL = SupportedFeatures(stage3=True, tensor_parallel=True, offload_param=True)


def error_of(config, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(config, **kwargs)
    return str(info.value)


# -- the table ------------------------------------------------------------------------------------------
def test_every_schema_field_is_classified():
    assert check_table_covers_schema(ShardwiseConfig) == []


def test_docs_table_matches_the_code_table():
    doc = (Path(__file__).parent.parent / "docs" / "config.md").read_text()
    begin, end = doc.index("<!-- keys:begin -->\n") + len("<!-- keys:begin -->\n"), doc.index("<!-- keys:end -->")
    assert doc[begin:end] == markdown(), "regenerate: python -m shardwise.config.keys --markdown"


@pytest.mark.subprocess
def test_markdown_cli():
    out = subprocess.run([sys.executable, "-m", "shardwise.config.keys", "--markdown"], capture_output=True,
                         text=True, check=True, cwd=Path(__file__).parent.parent).stdout
    assert out == markdown() and "| `communication_data_type` |" in out


def test_every_refused_key_has_an_off_value_and_refuses_on():
    for key in KEYS:
        if key.status == "refused":
            assert key.accepts is not None and key.accepts(None, {}), key.path


# Keys DeepSpeedExamples configs use that used to fail with "unknown key"; each accepted when off.
@pytest.mark.parametrize("config", [
    {"data_efficiency": {"enabled": False, "seed": 1234}},
    {"cuda_visible_devices": 0},
    {"torch_autocast": {"enabled": False, "dtype": "bfloat16"}},
    {"bf16": {"enabled": True, "bf16_master_weights_and_grads": False, "bf16_optimizer_states": False}},
    {"fp16": {"enabled": True, "fp16_master_weights_and_grads": False}},
    {"zero_optimization": {"stage": 2, "zenflow": None}},
    {"compile": {"deepcompile": False}},
    {"sequence_parallel_size": 1},
    {"dist_init_required": True},
    {"prescale_gradients": True, "gradient_predivide_factor": 8},
    {"comet": {"enabled": False}, "timers": {"throughput": {"enabled": True}}, "log_level": "info"},
    {"zero_optimization": {"stage": 3, "leaf_module": {"classes": ["X"]}, "model_persistence_threshold": 10,
                           "offload_optimizer": {"device": "cpu", "super_offload": False}}},
    {"communication_data_type": "bf16", "bf16": {"enabled": True}},
    {"data_types": {"grad_accum_dtype": "fp32"}, "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}},
    {"data_types": {"grad_accum_dtype": "fp32"}, "zero_optimization": {"stage": 1}, "bf16": {"enabled": True}},
    {"data_types": {"grad_accum_dtype": "float32"}, "fp16": {"enabled": True}},
])
def test_deepspeed_keys_accepted(config):
    load_config(config, world_size=1, supported=ALL)


@pytest.mark.parametrize("config, path, feature", [
    ({"data_efficiency": {"enabled": True}}, "data_efficiency", "data efficiency"),
    ({"torch_autocast": {"enabled": True}}, "torch_autocast", "torch.autocast"),
    ({"fp16": {"enabled": True, "auto_cast": True}}, "fp16.auto_cast", "auto_cast"),
    ({"zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0.1}}}, "zero_optimization.zenflow", "ZenFlow"),
    ({"compile": {"deepcompile": True}}, "compile", "DeepCompile"),
    ({"sparse_gradients": True}, "sparse_gradients", "sparse"),
    ({"amp": {"enabled": True, "opt_level": "O1"}}, "amp", "Apex"),
    ({"compression_training": {"weight_quantization": {"shared_parameters": {"enabled": True}}}},
     "compression_training", "compression"),
    ({"zero_optimization": {"stage": 1, "load_from_fp32_weights": False}}, "zero_optimization.load_from_fp32_weights",
     "fp32"),
    ({"checkpoint": {"load_universal": True}}, "checkpoint.load_universal", "universal"),
])
def test_refused_features_name_the_key(config, path, feature):
    msg = error_of(config, supported=ALL)
    assert msg.startswith(f"{path}: DeepSpeed feature") and feature in msg
    assert "is not implemented by shardwise" in msg and "unknown key" not in msg


@pytest.mark.parametrize("config, path", [
    ({"communication_data_type": "fp16", "bf16": {"enabled": True}}, "communication_data_type"),
    ({"communication_data_type": "fp32", "fp16": {"enabled": True}}, "communication_data_type"),
    ({"data_types": {"grad_accum_dtype": "bf16"}, "zero_optimization": {"stage": 1}}, "data_types.grad_accum_dtype"),
    ({"data_types": {"grad_accum_dtype": "bf16"}, "fp16": {"enabled": True}}, "data_types.grad_accum_dtype"),
])
def test_values_shardwise_does_not_implement_are_refused(config, path):
    msg = error_of(config, supported=ALL)
    assert msg.startswith(path + ": the value") and "is not implemented by shardwise" in msg


def test_gradient_allreduce_op_takes_deepspeeds_two_values():
    assert load_config({"gradient_allreduce_op": "sum"}).gradient_allreduce_op == "sum"
    assert load_config({}).gradient_allreduce_op == "mean"
    assert "gradient_allreduce_op" in error_of({"gradient_allreduce_op": "max"}, supported=ALL)


def test_every_honoured_key_reaches_the_schema():
    """A key the table calls honoured must not then fail validation as "unknown" (gradient_allreduce_op
    once did): each honoured top-level key is a schema field or a legacy name the schema renames."""
    from shardwise.config.keys import KEYS
    from shardwise.config.schema import ShardwiseConfig

    fields = set(ShardwiseConfig.model_fields)
    top = {k.path for k in KEYS if k.status == "honoured" and "." not in k.path}
    assert top <= fields, sorted(top - fields)


def test_ignored_keys_are_noted_once_and_off_values_are_silent():
    cfg = load_config({"timers": {"throughput": {"enabled": True}}, "dump_state": True,
                       "cuda_visible_devices": 0, "log_level": "info"})
    notes = cfg.ignored_keys
    assert len(notes) == 3 and all("accepted and ignored by shardwise" in n for n in notes)
    assert any("'timers'" in n for n in notes) and any("'dump_state'" in n for n in notes)


def test_typos_still_get_did_you_mean_from_deepspeed_names():
    assert "did you mean 'wall_clock_breakdown'" in error_of({"wall_clock_breakdwn": True})
    assert "did you mean 'data_efficiency'" in error_of({"data_eficiency": {}})
    assert "zero_optimization.zenflw: unknown key; did you mean 'zenflow'" in error_of(
        {"zero_optimization": {"zenflw": {}}})
    assert "data_types.grad_acum_dtype: unknown key" in error_of({"data_types": {"grad_acum_dtype": "fp32"}})


def test_refused_and_type_problems_are_reported_together():
    msg = error_of({"fp16": {"auto_cast": True}, "gradient_clipping": -1, "wandb": {}, "zero_optimization": 3})
    assert msg.startswith("3 problems") and "fp16.auto_cast" in msg and "gradient_clipping" in msg


# -- hostile files and values (issue 11, item 5) --------------------------------------------------------
def test_hjson_file_loads(tmp_path):
    path = tmp_path / "ds.hjson"
    path.write_text("{\n  # hjson: comments, unquoted keys, trailing commas\n  train_micro_batch_size_per_gpu: 4\n"
                    "  zero_optimization: {stage: 2, overlap_comm: true,}\n}\n")
    cfg = load_config(path, world_size=2)
    assert cfg.train_batch_size == 8 and cfg.zero_stage == 2 and cfg.zero_optimization.overlap_comm is True


@pytest.mark.parametrize("text", ['{"train_batch_size": 8, "train_batch_size": 16}',
                                  '{"zero_optimization": {"stage": 1, "stage": 2}}',
                                  '{train_batch_size: 8\n train_batch_size: 8\n}'])
def test_duplicate_keys_are_refused_naming_key_and_file(tmp_path, text):
    path = tmp_path / "dup.json"
    path.write_text(text)
    msg = error_of(path)
    assert str(path) in msg and "duplicate key" in msg and ("'train_batch_size'" in msg or "'stage'" in msg)


def test_deep_nesting_is_one_clear_error(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text('{"a": ' * 100_000 + "1" + "}" * 100_000)
    msg = error_of(path)
    assert "nested too deeply" in msg and str(path) in msg and "\n" not in msg
    deep: dict = {}
    node = deep
    for _ in range(2000):
        node["x"] = {}
        node = node["x"]
    assert "nested too deeply" in error_of(deep)


@pytest.mark.parametrize("text, path", [('{"optimizer": {"type": "Adam", "params": {"lr": Infinity}}}', "lr"),
                                        ('{"optimizer": {"type": "Adam", "params": {"lr": NaN}}}', "lr"),
                                        ('{"gradient_clipping": 1e400}', "gradient_clipping"),
                                        ('{"fp16": {"enabled": true, "loss_scale": -Infinity}}', "loss_scale")])
def test_non_finite_numbers_are_refused(tmp_path, text, path):
    file = tmp_path / "c.json"
    file.write_text(text)
    msg = error_of(file)
    assert path in msg and "finite" in msg


def test_non_finite_in_dicts_too():
    assert "finite" in error_of({"optimizer": {"type": "AdamW", "params": {"lr": math.inf}}})
    assert "finite" in error_of({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": math.nan}}})


@pytest.mark.parametrize("config, path", [({"train_micro_batch_size_per_gpu": 2**40}, "train_micro_batch_size"),
                                          ({"train_batch_size": 2**40}, "train_batch_size"),
                                          ({"gradient_accumulation_steps": 10**12}, "gradient_accumulation_steps"),
                                          ({"zero_optimization": {"reduce_bucket_size": 1e30}}, "reduce_bucket_size"),
                                          ({"tensor_parallel": {"autotp_size": 2**40}}, "autotp_size")])
def test_absurd_sizes_are_range_errors(config, path):
    msg = error_of(config)
    assert path in msg and ("less than or equal" in msg or "exceeded maximum size" in msg)


@pytest.mark.parametrize("config, path", [
    ({"zero_optimization": {"stage": 2, "cpu_offload": "false"}}, "zero_optimization.cpu_offload"),
    ({"zero_optimization": {"stage": 2, "cpu_offload_use_pin_memory": "false"}},
     "zero_optimization.cpu_offload_use_pin_memory"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": "false"}}},
     "zero_optimization.offload_optimizer.pin_memory"),
    ({"fp16": {"enabled": "false"}}, "fp16.enabled"),
    ({"bf16": {"enabled": 2}}, "bf16.enabled"),
    ({"prescale_gradients": "true"}, "prescale_gradients"),
    ({"optimizer": {"type": "Adam", "params": {"amsgrad": "no"}}}, "optimizer.params.amsgrad"),
])
def test_booleans_are_strict(config, path):
    msg = error_of(config)
    assert path in msg and "expected true or false" in msg


def test_integer_flags_one_and_zero_read_as_booleans_everywhere():
    """1/0 are true/false for honoured keys, and a refused section with "enabled": 1 (or an ambiguous
    "false" string) is refused, never dropped as if it were off."""
    cfg = load_config({"bf16": {"enabled": 1}, "zero_allow_untested_optimizer": 1, "prescale_gradients": 0})
    assert cfg.bf16.enabled is True and cfg.zero_allow_untested_optimizer is True and cfg.prescale_gradients is False
    assert "not implemented" in error_of({"communication_data_type": "fp32", "bf16": {"enabled": 1}}, supported=ALL)
    for on in (1, "false", True):
        assert "not implemented" in error_of({"amp": {"enabled": on}}, supported=ALL)
    assert load_config({"amp": {"enabled": 0}}).train_micro_batch_size_per_gpu == 1


def test_string_false_never_turns_offload_on():
    with pytest.warns(FutureWarning, match="cpu_offload"):
        cfg = load_config({"zero_optimization": {"stage": 2, "cpu_offload": False}})
    assert cfg.zero_optimization.offload_optimizer.device == "none"


# -- timeout --------------------------------------------------------------------------------------------
def test_timeout_key(tmp_path):
    assert timeout_of(None) is None and timeout_of({"train_batch_size": 1}) is None
    assert timeout_of({"shardwise": {"timeout_s": 30}}) == 30.0
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"shardwise": {"timeout_s": 45.5}}))
    assert timeout_of(path) == 45.5 and load_config(path).shardwise.timeout_s == 45.5
    for bad in (0, -1, "60", True, math.inf, math.nan, 10**9):
        with pytest.raises(ConfigError, match="shardwise.timeout_s"):
            timeout_of({"shardwise": {"timeout_s": bad}})
        with pytest.raises(ConfigError, match="shardwise.timeout_s"):
            load_config({"shardwise": {"timeout_s": bad}})
    assert "did you mean 'timeout_s'" in error_of({"shardwise": {"timeout": 5}})


# -- DeepSpeedExamples configs (copied as fixtures) -----------------------------------------------------
def test_deepspeed_examples_fixtures():
    """Small configs from deepspeedai/DeepSpeedExamples: each loads or is refused by name, never 'unknown'."""
    outcomes = {}
    for path in sorted(DATA.glob("dse_*.json")):
        try:
            load_config(path, world_size=1, supported=ALL)
            outcomes[path.name] = "load"
        except ConfigError as exc:
            assert "not implemented by shardwise" in str(exc), (path.name, str(exc))
            outcomes[path.name] = "refused"
    assert len(outcomes) >= 6 and "load" in outcomes.values() and "refused" in outcomes.values()


def test_refused_table_rows_are_reachable():
    """Each refused row with a simple boolean default refuses `true` through load_config."""
    for key in KEYS:
        if key.status != "refused" or key.subtree or key.accepts(True, {}):
            continue
        parts = key.path.split(".")
        config: dict = {}
        node = config
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = True
        msg = error_of(config, supported=ALL)
        assert key.path in msg and "not implemented by shardwise" in msg, key.path
    assert BY_PATH["fp16.auto_cast"].status == "refused"


@pytest.mark.subprocess
def test_initialize_applies_the_timeout_key(tmp_path):
    """A process of its own (forked after the imports, tests/fresh_ranks.py; no group, no launcher's
    environment): shardwise.initialize joins a world of one with shardwise.timeout_s as its timeout,
    over SHARDWISE_TIMEOUT."""
    import fresh_ranks

    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "SHARDWISE_TIMEOUT": "77"}
    rank = fresh_ranks.start("process_cases:timeout_key_applied", [], env, tmp_path / "rank")
    assert rank.wait(timeout=120) == 0, rank.communicate()[1][-2000:]
    assert rank.communicate()[0].strip().splitlines()[-1] == "42.0"


@pytest.mark.parametrize("config,world,words", [
    ({"sequence_parallel_size": 3}, 4, "does not divide the world size 4"),
    ({"sequence_parallel_size": 2, "tensor_parallel": {"autotp_size": 2}}, 6,
     "2 x tensor_parallel.autotp_size 2 does not divide the world size 6"),
])
def test_sequence_parallel_size_checked(config, world, words):
    with pytest.raises(ConfigError, match=words) as err:
        load_config({"train_micro_batch_size_per_gpu": 1, **config}, world_size=world,
                    supported=SupportedFeatures.everything())
    assert str(err.value).startswith(("sequence_parallel_size", "sequence_parallel_size with"))


def test_sequence_parallel_divides_the_batch_rule_by_sp():
    cfg = load_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                       "sequence_parallel_size": 2}, world_size=4)
    assert cfg.dp_world == 2 and cfg.train_batch_size == 4
    cfg = load_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                       "sequence_parallel_size": 2, "tensor_parallel": {"autotp_size": 2}}, world_size=8,
                      supported=SupportedFeatures.everything())
    assert cfg.dp_world == 2 and cfg.train_batch_size == 4  # TP x SP x DP = world


def test_the_pipeline_section_is_read_without_an_ignored_notice():
    """`pipeline` is read by shardwise/pipeline/ (`shardwise train --pp` writes `stages` into the config):
    no "accepted and ignored" line for it, and its keys stay in the config."""
    from shardwise.config import load_config

    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "pipeline": {"stages": 2, "schedule": "gpipe"}})
    assert not any("pipeline" in n for n in cfg.ignored_keys), cfg.ignored_keys
    assert cfg.pipeline == {"stages": 2, "schedule": "gpipe"}
