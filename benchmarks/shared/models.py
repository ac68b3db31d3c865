"""The model and the engine config that more than one benchmark builds: a Llama of a given shape from a
seed, and a ZeRO config with the benchmarks' AdamW (the GPU check's sections and the offload benchmark
compare their numbers, so they must build the same thing).
"""

from __future__ import annotations

import torch

LR, WD, BETAS, EPS = 1e-3, 0.01, (0.9, 0.999), 1e-8  # AdamW, the same in every run that is compared


def llama(shape: dict, device: torch.device | str = "cpu", seed: int = 0) -> torch.nn.Module:
    """A Llama of ``shape`` (LlamaConfig's keywords), its weights drawn from ``seed``: two runs that build
    it with the same seed start from the same weights, so their losses can be compared step by step."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    # a keyword of the constructor: set as an attribute afterwards it is a plain field transformers never reads
    cfg = LlamaConfig(max_position_embeddings=2048, tie_word_embeddings=False, attn_implementation="sdpa", **shape)
    with torch.device(device):
        return LlamaForCausalLM(cfg)


def engine_config(stage: int, precision: str, offload: str | None = None, micro: int = 2) -> dict:
    """A ZeRO ``stage`` config in ``precision`` (fp32 / bf16), with the optimizer's or the parameters'
    offload, no clipping and the AdamW above: the same math as the plain-torch run it is held against."""
    zero: dict = {"stage": stage, "overlap_comm": True}
    if offload == "optimizer":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if offload == "param":
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
           "steps_per_print": 0, "zero_optimization": zero,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD}}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg
