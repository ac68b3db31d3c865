"""ZeRO-Inference refuses weights that do not match the model (issue 11 item 6): by file and tensor,
before anything is generated, streamed from disk or CPU and on 2 ranks."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from inference_cases import save_tiny

from shardwise.inference.load import init_inference


def _rewrite_header(path: str, edit) -> None:
    """Apply ``edit(header)`` to the safetensors header of ``path``, data bytes unchanged."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header, data = json.loads(f.read(n)), f.read()
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + data)


@pytest.fixture
def folder(tmp_path) -> str:
    save_tiny("llama", str(tmp_path / "m"))
    return str(tmp_path / "m")


def _set_config(folder: str, **kv) -> None:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(kv)
    with open(path, "w") as f:
        json.dump(cfg, f)


@pytest.mark.parametrize("offload", ["disk", "cpu"])
def test_config_that_does_not_match_the_weights(folder, offload):
    _set_config(folder, intermediate_size=128)  # stored tensors have 96
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight' is "
                                         r"stored with shape .*config and weights do not match"):
        init_inference(folder, offload=offload)


def test_config_mismatch_on_two_ranks(pool2, folder):
    _set_config(folder, intermediate_size=128)
    with pytest.raises(Exception, match="config and weights do not match"):
        pool2.run("inference_cases:stream", folder, None)


@pytest.mark.parametrize("offload", ["disk", "cpu"])
def test_header_dtype_that_differs(folder, offload):
    name = "model.layers.1.self_attn.q_proj.weight"
    path = os.path.join(folder, "model.safetensors")
    _rewrite_header(path, lambda h: h[name].update(dtype="F16"))  # half the bytes the offsets span
    with pytest.raises(ValueError, match=f"{name}.*header and data disagree"):
        init_inference(folder, offload=offload)
    _rewrite_header(path, lambda h: h[name].update(dtype="I32"))  # same size, but integers
    with pytest.raises(ValueError, match=f"{name}.*not a floating-point dtype"):
        init_inference(folder, offload=offload)


def test_unknown_safetensors_dtype(folder):
    name = "model.norm.weight"
    _rewrite_header(os.path.join(folder, "model.safetensors"), lambda h: h[name].update(dtype="F8_E4M3"))
    with pytest.raises(ValueError, match=f"{name}.*'F8_E4M3'.*cannot stream"):
        init_inference(folder, offload="disk")


@pytest.mark.parametrize("entry", ["../outside/model.safetensors", "/etc/passwd", "sub/../../x.safetensors"])
def test_index_entries_outside_the_folder(folder, entry):
    index = {"metadata": {}, "weight_map": {"model.norm.weight": entry, "lm_head.weight": "model.safetensors"}}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    with pytest.raises(ValueError, match="index.json: entry 'model.norm.weight': path .* outside"):
        init_inference(folder, offload="disk")


def test_index_entry_symlinked_out_of_the_folder(folder, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(os.path.join(folder, "model.safetensors"), outside / "model.safetensors")
    os.symlink(outside / "model.safetensors", os.path.join(folder, "model.safetensors"))
    with pytest.raises(ValueError, match="resolves to .*, outside"):
        init_inference(folder, offload="disk")
