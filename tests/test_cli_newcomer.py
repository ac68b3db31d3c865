"""The command's first impressions: usage, --version, `env`, and every --help answering without torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shardwise.cli import command as cli
from shardwise.cli import env, parsers
from shardwise.units import human_bytes, human_counts


def test_bare_command_prints_usage_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: shardwise") and "quantize" in err.splitlines()[0] and "env" in err


def test_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ["launch", *cli.SUBCOMMANDS]:
        assert f"\n  {name} " in out, name


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import shardwise

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"shardwise {shardwise.__version__}"


@pytest.mark.subprocess
def test_every_subcommand_help_imports_no_torch() -> None:
    """The help of each subcommand comes from a torch-free parser (timing: benchmarks/cli/bench_help.py)."""
    code = ("import sys, contextlib, io\nfrom shardwise.cli import command as cli\n"
            "for cmd in ['train', 'estimate', 'consolidate', 'generate', 'quantize', 'env', 'launch']:\n"
            "    buf = io.StringIO()\n"
            "    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):\n"
            "        rc = cli.main([cmd, '--help'])\n"
            "    assert 'usage: shardwise ' + cmd in buf.getvalue(), (cmd, buf.getvalue()[:200])\n"
            "    bad = sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules)\n"
            "    assert not bad, (cmd, bad)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_generate_help_names_only_real_options() -> None:
    text = parsers.generate_parser().format_help()
    assert "--quantize cpu" not in text and "--quantize int8" in text


def test_torch_free_parsers_agree_with_the_formats() -> None:
    """The parsers repeat two constants of modules that import torch; they must not drift."""
    from shardwise.inference.quant_format import DEFAULT_GROUP
    from shardwise.inference.quantized_linear import BLOCK_ROWS

    assert parsers.DEFAULT_GROUP == DEFAULT_GROUP
    kernel = next(a for a in parsers.quantize_parser()._actions if a.dest == "kernel_order")
    assert sorted(kernel.choices) == sorted(BLOCK_ROWS)


def test_env_reports_versions_devices_and_the_facade(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    assert env.main(["--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["packages"]["torch"] == torch.__version__ and rep["packages"]["transformers"]
    assert "gloo" in rep["devices"]["backends"]
    assert rep["deepspeed_facade"]["modules_served"] > 10 and rep["deepspeed_facade"]["deepspeed_api"]
    assert set(rep["extras"]) >= {"hf", "monitor", "dev"}
    assert env.main([]) == 0
    text = capsys.readouterr().out
    assert "DeepSpeed facade" in text and f"torch         {torch.__version__}" in text


def test_human_units() -> None:
    assert human_bytes(512) == "512 B"
    assert human_bytes(1536) == "1.50 KiB"
    assert human_bytes(4853350400) == "4.52 GiB"
    assert human_bytes(300 * 2**20) == "300 MiB"
    assert human_counts({"all_gather": 4853350400, "broadcast": 0}) == "all_gather 4.52 GiB"


def test_byte_counts_print_in_human_units_and_stay_numbers() -> None:
    from shardwise.units import ByteCounts

    rep = ByteCounts({"params": 1572864, "grads": 0})
    assert rep == {"params": 1572864, "grads": 0} and rep["params"] + 1 == 1572865
    assert json.loads(json.dumps(rep)) == {"params": 1572864, "grads": 0}
    assert str(rep) == repr(rep) == "{'params': '1.50 MiB', 'grads': '0 B'}"
