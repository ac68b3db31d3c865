"""The ZeRO-Infinity configs of nvme_conformance.py, written after public ones (facts read, text not copied),
each a function of the swap folder; ``as_cpu`` makes the same config with CPU offload."""

import copy


def hf_docs(p):
    """HF transformers docs' NVMe example: aio INSIDE zero_optimization (as printed there), thread_count,
    auto values, stage3_* keys, sub_group_size 1e9, offload_param nvme with buffer_size/max_in_cpu."""
    return {
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": p,
                "pin_memory": True,
                "buffer_count": 4,
                "fast_init": False,
            },
            "offload_param": {
                "device": "nvme",
                "nvme_path": p,
                "pin_memory": True,
                "buffer_count": 5,
                "buffer_size": 1e8,
                "max_in_cpu": 1e9,
            },
            "aio": {
                "block_size": 262144,
                "queue_depth": 32,
                "thread_count": 1,
                "single_submit": False,
                "overlap_events": True,
            },
            "overlap_comm": True,
            "contiguous_gradients": True,
            "sub_group_size": 1e9,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "bf16": {"enabled": "auto"},
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "steps_per_print": 2000,
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "wall_clock_breakdown": False,
    }


def hf_docs_top_aio(p):
    c = hf_docs(p)
    c["aio"] = c["zero_optimization"].pop("aio")
    return c


def webui(p):
    """text-generation-webui's generate_ds_config: offload_param nvme only, buffer_size 1e9, sub_group_size 1e8,
    stage3 'auto' values, top-level aio with thread_count."""
    return {
        "fp16": {"enabled": False},
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {
                "device": "nvme",
                "nvme_path": p,
                "pin_memory": True,
                "buffer_count": 5,
                "buffer_size": 1e9,
                "max_in_cpu": 1e9,
            },
            "overlap_comm": True,
            "reduce_bucket_size": "auto",
            "contiguous_gradients": True,
            "sub_group_size": 1e8,
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_max_live_parameters": "auto",
            "stage3_max_reuse_distance": "auto",
        },
        "aio": {
            "block_size": 262144,
            "queue_depth": 32,
            "thread_count": 1,
            "single_submit": False,
            "overlap_events": True,
        },
        "steps_per_print": 2000,
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 1,
        "wall_clock_breakdown": False,
    }


def lightning(p):
    """Lightning DeepSpeedStrategy(stage=3, offload_optimizer=True, offload_parameters=True, *_device='nvme')
    defaults: pin_memory False, sub_group_size 1e12, buffer 5 x 1e8, max_in_cpu 1e9, optimizer buffer_count 4,
    aio block 1 MiB, qd 8, thread_count 1; fp16 with loss scaling 2^16."""
    return {
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {
            "stage": 3,
            "contiguous_gradients": True,
            "overlap_comm": True,
            "allgather_partitions": True,
            "reduce_scatter": True,
            "allgather_bucket_size": 2e8,
            "reduce_bucket_size": 2e8,
            "sub_group_size": 1e12,
            "offload_optimizer": {"device": "nvme", "nvme_path": p, "buffer_count": 4, "pin_memory": False},
            "offload_param": {
                "device": "nvme",
                "nvme_path": p,
                "buffer_count": 5,
                "buffer_size": 1e8,
                "max_in_cpu": 1e9,
                "pin_memory": False,
            },
        },
        "aio": {
            "block_size": 1048576,
            "queue_depth": 8,
            "single_submit": False,
            "overlap_events": True,
            "thread_count": 1,
        },
        "fp16": {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": 16,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        },
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
    }


def ds_examples(p):
    """DeepSpeedExamples / DS unit tests style: newer aio with intra_op_parallelism and use_gds false,
    pipeline_read/write, optimizer section, stage 3 with small buckets, optimizer on nvme, params on cpu, and
    sub_group_size cutting groups; max_in_cpu 0 style."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "stage3_max_live_parameters": 1e8,
            "stage3_max_reuse_distance": 1e8,
            "stage3_param_persistence_threshold": 1e3,
            "stage3_prefetch_bucket_size": 5e5,
            "reduce_bucket_size": 5e5,
            "sub_group_size": 4096,
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": p,
                "pin_memory": True,
                "buffer_count": 4,
                "pipeline_read": True,
                "pipeline_write": True,
                "fast_init": False,
                "ratio": 1.0,
            },
            "offload_param": {
                "device": "nvme",
                "nvme_path": p,
                "pin_memory": True,
                "buffer_count": 5,
                "buffer_size": 1e5,
                "max_in_cpu": 0,
            },
        },
        "aio": {
            "block_size": 1048576,
            "queue_depth": 16,
            "intra_op_parallelism": 2,
            "single_submit": False,
            "overlap_events": True,
            "use_gds": False,
        },
        "gradient_clipping": 1.0,
        "wall_clock_breakdown": False,
    }


def megatron_z2(p):
    """Megatron-DeepSpeed/bloom style: ZeRO-1/2 with optimizer offload nvme (DeepSpeed quietly makes it cpu)."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": 2,
            "allgather_partitions": True,
            "allgather_bucket_size": 5e5,
            "overlap_comm": True,
            "reduce_scatter": True,
            "reduce_bucket_size": 5e5,
            "contiguous_gradients": True,
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": p,
                "pin_memory": True,
                "buffer_count": 4,
                "pipeline_read": False,
                "pipeline_write": False,
                "fast_init": False,
            },
        },
        "aio": {
            "block_size": 1048576,
            "queue_depth": 8,
            "thread_count": 1,
            "single_submit": False,
            "overlap_events": True,
        },
        "bf16": {"enabled": True},
        "steps_per_print": 10,
        "wall_clock_breakdown": False,
    }


ALL = {
    "hf_docs_top_aio": hf_docs_top_aio,
    "webui": webui,
    "lightning": lightning,
    "ds_examples": ds_examples,
    "megatron_z2": megatron_z2,
}


def as_cpu(cfg):
    """The same config with every 'device': 'nvme' made 'cpu' (the other keys left as the user wrote them)."""
    c = copy.deepcopy(cfg)
    z = c["zero_optimization"]
    for k in ("offload_optimizer", "offload_param"):
        if k in z and z[k].get("device") == "nvme":
            z[k]["device"] = "cpu"
    return c
