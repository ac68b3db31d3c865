"""The DeepSpeed facade itself (shardwise/deepspeed/): what ``import deepspeed`` resolves to, its
package metadata, precedence over an installed DeepSpeed, refusals by name, the PYTHONPATH hook,
the ``deepspeed.ops`` optimizers' math, and the generated name list in docs/hf_trainer.md.

Installing the facade changes the interpreter's imports, so those checks run in subprocesses.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from shardwise.deepspeed import VERSION, name_table, ops, write_hook

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, *path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, path), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return res


def _fake_deepspeed(tmp: Path) -> Path:
    """A stand-in for an installed DeepSpeed (package and metadata) that marks itself when imported."""
    (tmp / "deepspeed").mkdir(parents=True)
    (tmp / "deepspeed" / "__init__.py").write_text("REAL = True\n")
    (tmp / "deepspeed-0.19.8.dist-info").mkdir()
    (tmp / "deepspeed-0.19.8.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\n"
                                                                  "Version: 0.19.8\n")
    return tmp


@pytest.mark.subprocess
def test_install_serves_every_listed_name_and_refuses_the_rest():
    _python(f"""
        import importlib, importlib.metadata, importlib.util
        import shardwise
        shardwise.install_as_deepspeed()
        shardwise.install_as_deepspeed()  # idempotent
        import deepspeed
        from shardwise.deepspeed import SURFACE, DeepSpeedNameNotImplemented
        from transformers.integrations.deepspeed import is_deepspeed_available
        from accelerate.utils import compare_versions, is_deepspeed_available as acc_available
        assert importlib.util.find_spec("deepspeed") is not None
        assert importlib.metadata.version("deepspeed") == {VERSION!r} == deepspeed.__version__
        for module, table in SURFACE.items():
            mod = importlib.import_module(module)
            for name, value in table.items():
                assert getattr(mod, name) is value, (module, name)
        assert deepspeed.runtime.zero.partition_parameters.Init is shardwise.zero.Init
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPFwdLossBwdWithLogits
        assert compare_versions("deepspeed", ">=", "0.18.2")  # Accelerate's check for its SP path
        for use in (lambda: UlyssesSPFwdLossBwdWithLogits(), lambda: deepspeed.moe.layer.MoE(),
                    lambda: isinstance(1, deepspeed.DualPipeVModule)):
            try:
                use()
                raise AssertionError("not refused")
            except DeepSpeedNameNotImplemented as e:
                assert "is not implemented by shardwise" in str(e) and "deepspeed." in str(e), e
        try:
            deepspeed.utils.no_such_function()
        except NotImplementedError as e:
            assert "deepspeed.utils.no_such_function" in str(e), e

        assert is_deepspeed_available() and acc_available() and compare_versions("deepspeed", ">=", "0.16.4")
    """)


@pytest.mark.subprocess
def test_installed_deepspeed_is_never_used(tmp_path):
    """The hook (PYTHONPATH, as under plain torchrun) and install_as_deepspeed() both win over an
    installed DeepSpeed, for the import and for the metadata, and say so once on stderr."""
    fake = _fake_deepspeed(tmp_path / "site")
    hook = write_hook(tmp_path / "hook")
    res = _python(f"""
        import importlib.metadata
        assert importlib.metadata.version("deepspeed") == {VERSION!r}  # before anything imported it
        import deepspeed, deepspeed.comm
        import shardwise
        shardwise.install_as_deepspeed()
        assert "REAL" not in vars(deepspeed) and deepspeed.__version__ == {VERSION!r}
    """, hook, fake)
    assert len(re.findall("DeepSpeed is installed", res.stderr)) == 1, res.stderr
    res = _python(f"""
        import shardwise
        shardwise.install_as_deepspeed()
        import deepspeed, importlib.metadata
        assert "REAL" not in vars(deepspeed) and importlib.metadata.version("deepspeed") == {VERSION!r}
    """, fake)
    assert "DeepSpeed is installed" in res.stderr


@pytest.mark.subprocess
def test_install_after_a_real_import_is_refused(tmp_path):
    fake = _fake_deepspeed(tmp_path)
    _python("""
        import deepspeed, shardwise
        try:
            shardwise.install_as_deepspeed()
            raise AssertionError("not refused")
        except RuntimeError as e:
            assert "before anything imports deepspeed" in str(e), e
    """, fake)


def _steps(opt_cls, kwargs: dict, steps: int = 3) -> torch.Tensor:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64))
    opt = opt_cls([p], **kwargs)
    for i in range(steps):
        p.grad = torch.randn(64, generator=torch.Generator().manual_seed(i))
        opt.step()
    return p.detach().clone()


@pytest.mark.parametrize("ours, theirs, kw_ours, kw_theirs", [
    (ops.DeepSpeedCPUAdam, torch.optim.AdamW, {"weight_decay": 0.1}, {"weight_decay": 0.1}),
    (ops.DeepSpeedCPUAdam, torch.optim.Adam, {"weight_decay": 0.1, "adamw_mode": False}, {"weight_decay": 0.1}),
    (ops.FusedAdam, torch.optim.AdamW, {"weight_decay": 0.1}, {"weight_decay": 0.1}),
    (ops.DeepSpeedCPUAdagrad, torch.optim.Adagrad, {"lr": 0.1}, {"lr": 0.1}),
])
def test_ops_optimizers_are_torch_math(ours, theirs, kw_ours, kw_theirs):
    assert torch.equal(_steps(ours, kw_ours), _steps(theirs, kw_theirs))


def test_lion_update_rule():
    """Lion (sign of the interpolated momentum, decoupled decay), against the formula in float64."""
    lr, b1, b2, wd = 1e-2, 0.9, 0.99, 0.1
    got = _steps(ops.DeepSpeedCPULion, {"lr": lr, "betas": (b1, b2), "weight_decay": wd})
    torch.manual_seed(0)
    p, m = torch.randn(64).double(), torch.zeros(64).double()
    for i in range(3):
        g = torch.randn(64, generator=torch.Generator().manual_seed(i)).double()
        p = p * (1 - lr * wd) - lr * torch.sign(b1 * m + (1 - b1) * g)
        m = b2 * m + (1 - b2) * g
    assert torch.allclose(got.double(), p, rtol=0, atol=1e-6)


def test_ops_refuse_what_torch_lacks():
    with pytest.raises(NotImplementedError, match="bias_correction"):
        ops.DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(2))], bias_correction=False)


def test_doc_lists_every_served_name():
    """docs/hf_trainer.md holds the output of `python -m shardwise.deepspeed names` verbatim."""
    doc = (ROOT / "docs" / "hf_trainer.md").read_text()
    block = re.search(r"<!-- names:begin -->\n(.*?)<!-- names:end -->", doc, re.S)
    assert block is not None and block.group(1) == name_table(), \
        "regenerate: python -m shardwise.deepspeed names --update docs/hf_trainer.md"


def test_conformance_tool_reads_the_facade_errors():
    """tools/ds_conformance.py classifies failures by the facade's error message."""
    import importlib.util

    from shardwise.deepspeed import DeepSpeedNameNotImplemented

    spec = importlib.util.spec_from_file_location("ds_conformance", ROOT / "tools" / "ds_conformance.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    for name, use, cause in [("deepspeed.zero.TiledLinear", " called", "missing public API"),
                             ("deepspeed.runtime.zero.partition_parameters.ZeroParamStatus", "",
                              "reads DeepSpeed internals"),
                             ("deepspeed.accelerator.get_accelerator().foo", "", "harness (accelerator)")]:
        assert tool.classify(f"E   {DeepSpeedNameNotImplemented(name, use)}\n") == cause


def test_a_config_without_gradient_clipping_gets_deepspeeds_default(tmp_path):
    """DeepSpeed 0.19.8 clips at a global norm of 1.0 when the config has no gradient_clipping; the facade's
    initialize gives its config that default from every source (config, config_params, args.deepspeed_config),
    keeps an explicit value, and leaves the caller's dict and args alone."""
    import argparse
    import json

    from shardwise.deepspeed.stage3 import with_deepspeed_defaults

    mine = {"train_micro_batch_size_per_gpu": 1}
    _, kw = with_deepspeed_defaults((), {"model": None, "config": mine})
    assert kw["config"]["gradient_clipping"] == 1.0 and "gradient_clipping" not in mine
    _, kw = with_deepspeed_defaults((), {"config_params": {**mine, "gradient_clipping": 0.0}})
    assert kw["config"]["gradient_clipping"] == 0.0 and "config_params" not in kw
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(mine))
    args = argparse.Namespace(deepspeed_config=str(path), local_rank=0)
    got_args, kw = with_deepspeed_defaults((args,), {})
    assert kw["config"]["gradient_clipping"] == 1.0 and got_args[0].deepspeed_config is None
    assert args.deepspeed_config == str(path) and got_args[0].local_rank == 0
    both = ((args,), {"config": mine})  # two configs: handed on unchanged, for initialize's one line
    assert with_deepspeed_defaults(*both) == both
