"""Tests for shardwise.config: real DeepSpeed/HF configs load, every problem names its key path."""

import copy
import json

import pytest
import torch

from shardwise.config import ConfigError, ShardwiseConfig, SupportedFeatures, load_config

# The ZeRO-2 config from the Hugging Face Trainer DeepSpeed docs, unchanged.
HF_ZERO2 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}

# A hand-written DeepSpeed config: stage 2, CPU optimizer offload, WarmupDecayLR, monitors.
DS_STAGE2 = {
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 8,
    "gradient_clipping": 1.0,
    "steps_per_print": 100,
    "bf16": {"enabled": True},
    "optimizer": {"type": "Adam", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                             "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4,
                                                      "warmup_num_steps": 100, "total_num_steps": 5000,
                                                      "warmup_type": "linear"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False},
                          "contiguous_gradients": True, "overlap_comm": False, "reduce_scatter": True,
                          "reduce_bucket_size": 5e8, "allgather_bucket_size": 500000000,
                          "round_robin_gradients": True,
                          "stage3_prefetch_bucket_size": 1e7},  # ignored below stage 3, as in DeepSpeed
    "tensorboard": {"enabled": True, "output_path": "runs/", "job_name": "x"},
    "wandb": {"enabled": False, "project": "p"},
    "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False},
    "data_types": {"grad_accum_dtype": "fp32"},
    "zero_allow_untested_optimizer": True,
}


def error_of(config, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(config, **kwargs)
    return str(info.value)


# -- real configs ---------------------------------------------------------------------------------------
def test_hf_all_auto_zero2_resolves():
    cfg = load_config(copy.deepcopy(HF_ZERO2), world_size=4, hidden_size=1024)
    assert isinstance(cfg, ShardwiseConfig)
    sizes = (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps)
    assert sizes == (4, 1, 1)
    assert cfg.gradient_clipping == 1.0
    assert cfg.precision == "fp32" and cfg.compute_dtype is torch.float32
    assert cfg.optimizer.type == "AdamW"
    assert cfg.optimizer.params["lr"] == 1e-3 and cfg.optimizer.params["betas"] == (0.9, 0.999)
    assert cfg.optimizer.params["eps"] == 1e-8 and cfg.optimizer.params["weight_decay"] == 0.01
    assert cfg.scheduler.params == {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 1000,
                                    "warmup_type": "log", "last_batch_iteration": -1}
    z = cfg.zero_optimization
    assert cfg.zero_stage == 2 and z.reduce_bucket_size == 200_000_000
    assert isinstance(z.reduce_bucket_size, int)
    assert z.offload_optimizer.device == "cpu" and z.offload_optimizer.pin_memory is True
    assert cfg.steps_per_print == 2000 and cfg.dp_world == 4 and cfg.tp_size == 1


def test_input_dict_is_not_modified():
    config = copy.deepcopy(HF_ZERO2)
    load_config(config, world_size=2)
    assert config == HF_ZERO2


def test_deepspeed_stage2_offload_warmupdecay():
    cfg = load_config(DS_STAGE2, world_size=2)
    assert cfg.gradient_accumulation_steps == 4  # 64 / (8 × 2)
    assert cfg.precision == "bf16" and cfg.compute_dtype is torch.bfloat16
    assert cfg.optimizer.type == "Adam" and cfg.optimizer.params["betas"] == (0.9, 0.95)
    assert cfg.optimizer.params["adam_w_mode"] is True  # DeepSpeed's Adam decouples weight decay
    assert cfg.scheduler.type == "WarmupDecayLR" and cfg.scheduler.params["total_num_steps"] == 5000
    assert cfg.scheduler.params["warmup_type"] == "linear"
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert cfg.zero_optimization.stage3_prefetch_bucket_size == 10_000_000
    assert cfg.tensorboard["output_path"] == "runs/" and cfg.data_types == {"grad_accum_dtype": "fp32"}


def test_none_gives_defaults():
    cfg = load_config(None)
    assert cfg.zero_stage == 0 and cfg.precision == "fp32" and cfg.gradient_clipping == 0.0
    assert cfg.steps_per_print == 10 and cfg.optimizer is None and cfg.scheduler is None
    assert cfg.zero_optimization.overlap_comm is False
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000


def test_json_file_loading(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(DS_STAGE2))
    assert load_config(path, world_size=2).gradient_accumulation_steps == 4
    assert load_config(str(path), world_size=2).train_batch_size == 64


def test_missing_file_and_bad_json_name_the_path(tmp_path):
    missing = tmp_path / "nope.json"
    assert str(missing) in error_of(missing) and "does not exist" in error_of(missing)
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 8, "fp16": {')  # unterminated: neither JSON nor hjson
    msg = error_of(bad)
    assert str(bad) in msg and "not valid JSON" in msg and "line 1" in msg
    arr = tmp_path / "list.json"
    arr.write_text("[1, 2]")
    assert "JSON object" in error_of(arr)


# -- "auto" ---------------------------------------------------------------------------------------------
def test_auto_buckets_from_hidden_size():
    zero = {"stage": 2, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto", "overlap_comm": "auto", "sub_group_size": "auto"}
    z = load_config({"zero_optimization": zero}, hidden_size=1000).zero_optimization
    assert z.reduce_bucket_size == 1_000_000 and z.stage3_prefetch_bucket_size == 900_000
    assert z.stage3_param_persistence_threshold == 10_000 and z.overlap_comm is True
    assert z.sub_group_size == 1_000_000_000
    z = load_config({"zero_optimization": zero}).zero_optimization  # no hidden size: DeepSpeed defaults
    assert z.reduce_bucket_size == 500_000_000 and z.stage3_prefetch_bucket_size == 50_000_000
    assert z.stage3_param_persistence_threshold == 100_000


def test_auto_optimizer_defaults_per_type_and_warmup_max_lr_follows_lr():
    cfg = load_config({"optimizer": {"type": "adam", "params": {"lr": 5e-5, "weight_decay": "auto"}},
                       "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}})
    assert cfg.optimizer.type == "Adam" and cfg.optimizer.params["weight_decay"] == 0.0
    assert cfg.scheduler.params["warmup_max_lr"] == 5e-5
    sgd = load_config({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": "auto"}}}).optimizer
    assert sgd.params["momentum"] == 0.0 and sgd.params["lr"] == 0.1


def test_auto_total_num_steps_is_an_error():
    msg = error_of({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}})
    assert msg.startswith("scheduler.params.total_num_steps:") and "WarmupLR" in msg
    msg = error_of({"scheduler": {"type": "WarmupCosineLR", "params": {}}})
    assert msg.startswith("scheduler.params.total_num_steps:")


def test_auto_stage_is_an_error():
    assert error_of({"zero_optimization": {"stage": "auto"}}).startswith("zero_optimization.stage:")


def test_overlap_comm_default_follows_stage():
    stage3 = load_config({"zero_optimization": {"stage": 3}}, supported=SupportedFeatures(stage3=True))
    assert stage3.zero_optimization.overlap_comm is True
    assert load_config({"zero_optimization": {"stage": 2}}).zero_optimization.overlap_comm is False


# -- deprecated aliases ---------------------------------------------------------------------------------
def test_bfloat16_alias_warns_and_maps():
    with pytest.warns(FutureWarning, match="'bfloat16' is deprecated; use 'bf16'"):
        cfg = load_config({"bfloat16": {"enabled": True}})
    assert cfg.bf16.enabled and cfg.precision == "bf16"


def test_cpu_offload_alias_warns_and_maps():
    with pytest.warns(FutureWarning, match="zero_optimization.cpu_offload"):
        cfg = load_config({"zero_optimization": {"stage": 2, "cpu_offload": True}})
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"


def test_gather_fp16_alias_warns_and_maps():
    with pytest.warns(FutureWarning, match="stage3_gather_16bit_weights_on_model_save"):
        cfg = load_config({"zero_optimization": {"stage3_gather_fp16_weights_on_model_save": True}})
    assert cfg.zero_optimization.stage3_gather_16bit_weights_on_model_save is True


def test_deepspeed_short_names_for_stage3_keys():
    cfg = load_config({"zero_optimization": {"prefetch_bucket_size": 123, "max_live_parameters": 7}})
    assert cfg.zero_optimization.stage3_prefetch_bucket_size == 123
    assert cfg.zero_optimization.stage3_max_live_parameters == 7


def test_alias_and_new_key_conflict():
    with pytest.warns(FutureWarning):
        msg = error_of({"bfloat16": {"enabled": True}, "bf16": {"enabled": False}})
    assert "bfloat16" in msg and "keep only 'bf16'" in msg


# -- unknown keys, types and ranges ---------------------------------------------------------------------
@pytest.mark.parametrize("config, expected", [
    ({"train_batch_sise": 8}, "train_batch_sise: unknown key; did you mean 'train_batch_size'?"),
    ({"zero_optimization": {"reduce_bucket_sise": 5}},
     "zero_optimization.reduce_bucket_sise: unknown key; did you mean 'reduce_bucket_size'?"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memroy": True}}},
     "zero_optimization.offload_optimizer.pin_memroy: unknown key; did you mean 'pin_memory'?"),
    ({"optimizer": {"type": "AdamW", "params": {"weight_decya": 0.1}}},
     "optimizer.params.weight_decya: unknown key; did you mean 'weight_decay'?"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 10}}},
     "scheduler.params.warmup_num_step: unknown key; did you mean 'warmup_num_steps'?"),
])
def test_misspelled_keys_name_full_path_and_suggestion(config, expected):
    assert error_of(config) == expected


def test_unknown_key_without_close_match_lists_valid_keys():
    msg = error_of({"fp16": {"zzz": 1}})
    assert msg.startswith("fp16.zzz: unknown key; valid keys:") and "loss_scale_window" in msg


def test_free_form_sections_are_not_checked():
    cfg = load_config({"csv_monitor": {}, "checkpoint": {"use_node_local_storage": True}})
    assert cfg.checkpoint == {}  # classified sub-keys: ignored ones are dropped (and noted)
    # the monitoring sections are honoured (shardwise/monitor/), so checked: a typo is not a silent default
    msg = error_of({"flops_profiler": {"anything": 1}, "comms_logger": {"x": [1]}})
    assert "flops_profiler.anything: unknown key" in msg and "comms_logger.x: unknown key" in msg


def test_type_and_range_errors_name_the_key():
    assert error_of({"zero_optimization": {"stage": 5}}).startswith("zero_optimization.stage: ")
    assert error_of({"zero_optimization": {"reduce_bucket_size": -1}}).startswith(
        "zero_optimization.reduce_bucket_size: ")
    assert error_of({"fp16": {"enabled": "yes please"}}).startswith("fp16.enabled: ")
    assert error_of({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}}).startswith(
        "zero_optimization.offload_optimizer.device: ")
    assert error_of({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.5]}}}).startswith(
        "optimizer.params.betas")
    assert error_of({"train_micro_batch_size_per_gpu": 0}).startswith("train_micro_batch_size_per_gpu: ")


def test_several_problems_are_listed_together():
    msg = error_of({"zero_optimization": {"stage": 5, "reduce_bucket_size": -1}, "steps_per_prnt": 1})
    assert "3 problems" in msg
    for path in ("zero_optimization.stage", "zero_optimization.reduce_bucket_size", "steps_per_prnt"):
        assert path in msg


def test_optimizer_and_scheduler_types():
    assert "did you mean 'AdamW'" in error_of({"optimizer": {"type": "AdamWW"}})
    msg = error_of({"optimizer": {"type": "OneBitAdam"}})
    assert msg.startswith("optimizer.type:") and "is not implemented by shardwise" in msg and "client optimizer" in msg
    assert "not implemented by shardwise" in error_of({"optimizer": {"type": "OneBitLamb"}})
    lamb = load_config({"train_batch_size": 2, "optimizer": {"type": "lamb", "params": {"max_coeff": 5.0}}})
    assert lamb.optimizer.type == "Lamb" and lamb.optimizer.params["min_coeff"] == 0.01  # FusedLamb's default
    muon = load_config({"train_batch_size": 2, "optimizer": {"type": "Muon", "params": {"muon_lr": 0.02}}})
    assert muon.optimizer.params["muon_lr"] == 0.02 and muon.optimizer.params["adam_lr"] is None
    assert "optimizer.params.ns_method" in error_of({"optimizer": {"type": "Muon", "params": {"ns_method": "x"}}})
    msg = error_of({"scheduler": {"type": "OneCycle"}})
    assert msg.startswith("scheduler.type:") and "not implemented by shardwise" in msg
    assert "did you mean 'WarmupLR'" in error_of({"scheduler": {"type": "warmuplr"}})
    assert error_of({"optimizer": {"params": {}}}) == "optimizer.type: required key is missing"


# -- batch rule -----------------------------------------------------------------------------------------
def batch(world_size=2, **given):
    cfg = load_config(given, world_size=world_size)
    return cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps


def test_batch_rule_completion_branches():
    assert batch(train_batch_size=32, train_micro_batch_size_per_gpu=4,
                 gradient_accumulation_steps=4) == (32, 4, 4)
    assert batch(train_batch_size=32, train_micro_batch_size_per_gpu=4) == (32, 4, 4)
    assert batch(train_batch_size=32, gradient_accumulation_steps=2) == (32, 8, 2)
    assert batch(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=3) == (24, 4, 3)
    assert batch(train_batch_size=32) == (32, 16, 1)
    assert batch(train_micro_batch_size_per_gpu=4) == (8, 4, 1)
    assert batch(gradient_accumulation_steps=5) == (10, 1, 5)
    assert batch() == (2, 1, 1)
    assert batch(train_batch_size="auto", train_micro_batch_size_per_gpu=2) == (4, 2, 1)


def test_batch_rule_inconsistent_names_all_three_fixes():
    msg = error_of({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                    "gradient_accumulation_steps": 2}, world_size=2)
    assert msg.startswith("train_batch_size: 32 != ")
    assert "set train_batch_size to 16" in msg and "set gradient_accumulation_steps to 4" in msg
    assert '"auto"' in msg


@pytest.mark.parametrize("given", [
    {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4},
    {"train_batch_size": 30, "gradient_accumulation_steps": 4},
    {"train_batch_size": 7},
])
def test_batch_rule_not_divisible(given):
    msg = error_of(given, world_size=2)
    assert msg.startswith("train_batch_size: ") and "not divisible" in msg


def test_batch_rule_uses_data_parallel_world_only():
    cfg = load_config({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
                       "tensor_parallel": {"autotp_size": 2}},
                      world_size=4, supported=SupportedFeatures(tensor_parallel=True))
    assert cfg.tp_size == 2 and cfg.dp_world == 2 and cfg.gradient_accumulation_steps == 2


# -- supported features, precision ----------------------------------------------------------------------
@pytest.mark.parametrize("config, path, flag", [
    ({"zero_optimization": {"stage": 3}}, "zero_optimization.stage", "stage3"),
    ({"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel.autotp_size", "tensor_parallel"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
     "zero_optimization.offload_param.device", "offload_param"),
])
def test_unsupported_features_are_named_and_flags_enable_them(config, path, flag):
    msg = error_of(config, world_size=2)
    assert "is not enabled in this load_config call" in msg and path in msg and f"{flag}=True" in msg
    load_config(config, world_size=2, supported=SupportedFeatures(**{flag: True}))  # accepted when enabled


@pytest.mark.parametrize("config, path", [
    ({"zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True}},
     "zero_optimization.zero_quantized_nontrainable_weights"),
    ({"zero_optimization": {"stage": 3, "zeropp_loco_param": {"err_beta": 0.8}}},
     "zero_optimization.zeropp_loco_param"),
])
def test_zeropp_is_refused(config, path):
    msg = error_of(config, world_size=2, supported=SupportedFeatures(stage3=True, tensor_parallel=True,
                                                                    offload_param=True))
    assert msg.startswith(path + ": DeepSpeed feature") and "is not implemented by shardwise" in msg


def test_mics_shard_size_is_hybrid_sharding():
    z = {"zero_optimization": {"stage": 2, "mics_shard_size": 2}}
    assert "hybrid=True" in error_of(z, world_size=4)  # only initialize (which builds the mesh) enables it
    cfg = load_config(z, world_size=4, supported=SupportedFeatures(hybrid=True))
    assert cfg.zero_optimization.mics_shard_size == 2


def test_stage3_keys_below_stage3_are_fine_and_nvme_offload_loads():
    cfg = load_config({"zero_optimization": {"stage": 1, "stage3_max_live_parameters": 1e9,
                                             "stage3_param_persistence_threshold": 1e4}})
    assert cfg.zero_stage == 1 and cfg.zero_optimization.stage3_param_persistence_threshold == 10_000
    cfg = load_config({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/n"}}})
    assert cfg.zero_optimization.offload_optimizer.device == "nvme"  # ZeRO-Infinity's optimizer tier: nvme/
    cfg = load_config({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/n"}}},
                      supported=SupportedFeatures(stage3=True, offload_param=True))
    assert cfg.zero_optimization.offload_param.device == "nvme"  # the stage-3 shards in swap files


def test_offload_optimizer_needs_stage_1():
    msg = error_of({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}})
    assert msg.startswith("zero_optimization.offload_optimizer.device:") and "stage" in msg


def test_tensor_parallel_size_sources_must_agree():
    features = SupportedFeatures(tensor_parallel=True)
    cfg = load_config({"tensor_parallel": {"tp": {"tp_size": 2}}}, world_size=4, supported=features)
    assert cfg.tp_size == 2
    assert load_config(None, world_size=4, tp_size_hint=4, supported=features).dp_world == 1
    msg = error_of({"tensor_parallel": {"autotp_size": 2}}, world_size=4, tp_size_hint=4, supported=features)
    assert msg.startswith("tensor_parallel.autotp_size: conflicting")
    msg = error_of({"tensor_parallel": {"autotp_size": 3}}, world_size=4, supported=features)
    assert msg.startswith("tensor_parallel.autotp_size: 3 does not divide")


def test_fp16_and_bf16_conflict():
    msg = error_of({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert "fp16.enabled" in msg and "bf16.enabled" in msg


def test_fp16_settings():
    cfg = load_config({"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12}})
    assert cfg.precision == "fp16" and cfg.compute_dtype is torch.float16
    assert cfg.fp16.initial_scale_power == 12 and cfg.fp16.hysteresis == 2 and cfg.fp16.loss_scale == 0.0
