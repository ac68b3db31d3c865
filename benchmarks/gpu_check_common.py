"""Helpers shared by the gpu_check sections (benchmarks/gpu_check_sections.py, gpu_check_perf.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

SECTIONS_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_check_sections.py")
LR, WD, BETAS, EPS = 1e-3, 0.01, (0.9, 0.999), 1e-8
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "vocab_size": 512}
STAGE_MODEL = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
               "num_key_value_heads": 4, "vocab_size": 1024}
MODEL_1B = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16, "num_attention_heads": 16,
            "num_key_value_heads": 16, "vocab_size": 32000}  # 0.95B parameters
MODEL_13B = {"hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40, "num_attention_heads": 40,
             "num_key_value_heads": 40, "vocab_size": 32000}  # Llama-2-13B's shape: 13.0B parameters


def cuda() -> bool:
    return torch.cuda.is_available()


def skip(reason: str) -> dict:
    return {"status": "skipped", "reason": reason, "rows": []}


def llama(shape: dict, device: torch.device | str = "cpu", seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    # a keyword of the constructor: set as an attribute afterwards it is a plain field transformers never reads
    cfg = LlamaConfig(max_position_embeddings=2048, tie_word_embeddings=False, attn_implementation="sdpa", **shape)
    with torch.device(device):
        return LlamaForCausalLM(cfg)


def join_world_of_one() -> None:
    """NCCL with CUDA (gloo without), one rank: what a single-GPU job gets from init_distributed."""
    import shardwise

    shardwise.init_distributed()


def engine_config(stage: int, precision: str, offload: str | None = None, micro: int = 2) -> dict:
    zero: dict = {"stage": stage, "overlap_comm": True}
    if offload == "optimizer":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cuda()}
    if offload == "param":
        zero["offload_param"] = {"device": "cpu", "pin_memory": cuda()}
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
           "steps_per_print": 0, "zero_optimization": zero,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD}}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


_RESULT: list[str] = []  # this section process's result file; empty when sections run in one process (--smoke)


def keep_result_at(path: str) -> None:
    _RESULT[:] = [path]


def save_partial(rows: list[dict], **extra: object) -> None:
    """The rows so far into the result file, so a section killed at its time limit still leaves them
    (written aside and renamed: a kill mid-write never leaves half a JSON)."""
    if not _RESULT:
        return
    tmp = _RESULT[0] + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"status": "partial", "rows": rows, **extra}, f, indent=1)
    os.replace(tmp, _RESULT[0])


def run_child(args: list[str], result: str, timeout_s: float) -> dict:
    """This script again, in a fresh process (a clean peak memory per run); its result or the error."""
    if timeout_s < 15:  # not even the imports and the NCCL setup would finish
        return {"error": f"not run: {max(timeout_s, 0):.0f} s left in the section's limit"}
    if os.path.exists(result):  # the workdir is kept between runs: never report an earlier run's numbers
        os.remove(result)
    cmd = [sys.executable, SECTIONS_SCRIPT, *args, "--result", result]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout_s, 1))
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    try:
        with open(result) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"}
