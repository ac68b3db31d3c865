"""Run DeepSpeed's own unit tests against shardwise, with only ``import deepspeed`` changed.

Usage::

    python tools/ds_conformance.py /path/to/DeepSpeed-checkout [--out DIR] [--timeout S] [FILE ...]

The script fetches nothing: give it a DeepSpeed source checkout (a git clone). It copies that
checkout's ``tests/`` into a scratch folder, puts the PYTHONPATH hook of shardwise's DeepSpeed
facade (``python -m shardwise.deepspeed hook``: ``import deepspeed`` is shardwise, see
docs/hf_trainer.md) ahead of the repository on ``PYTHONPATH``, runs each test file in its own
pytest process on DeepSpeed's harness (2 gloo ranks per test; one hung file cannot end the run),
and writes ``results.json`` and ``report.md`` with every test's outcome and, for a failure, its
cause class (see :func:`classify`). DeepSpeed's code is never copied into this repository.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# DeepSpeed's CPU accelerator reports LOCAL_SIZE devices (the facade's does too): ranks share the
# CPU here, so 8 keeps DeepSpeed's harness from skipping its 2-4 rank tests for "too few devices".
HARNESS_ENV = {"LOCAL_SIZE": "8", "OMP_NUM_THREADS": "1", "DS_DISABLE_REUSE_DIST_ENV": "1"}
# The facade's error for a DeepSpeed name it does not serve: "<name>[ called|...]: ... DeepSpeed facade"
MISSING = re.compile(r"(deepspeed\.\S+?)(?: called| in \w+\(\))?: [^\n]*DeepSpeed facade")

# The public-API test files of the conformance target (issue 10), relative to tests/.
DEFAULT_FILES = [
    "unit/runtime/zero/test_ignore_unused_parameters.py",
    "unit/runtime/zero/test_unwrap_model.py",
    "unit/runtime/zero/test_zero_context.py",
    "unit/runtime/zero/test_zero_context_return.py",
    "unit/runtime/zero/test_zero_context_ancestry.py",
    "unit/runtime/zero/test_zero_nesting_init.py",
    "unit/runtime/zero/test_zero_dynamic_class.py",
    "unit/runtime/zero/test_zero_leaf_module.py",
    "unit/runtime/zero/test_zero_grad_clip.py",
    "unit/runtime/zero/test_zero_config.py",
    "unit/runtime/zero/test_zero_late_module_attach.py",
    "unit/runtime/zero/test_zero_allreduce_fetch_params.py",
    "unit/runtime/test_no_sync_ctxt.py",
    "unit/runtime/test_ds_config_dict.py",
    "unit/runtime/test_ds_initialize.py",
    "unit/checkpoint/test_tag_validation.py",
    "unit/checkpoint/test_latest_checkpoint.py",
    "unit/checkpoint/test_shared_weights.py",
    "unit/checkpoint/test_convert_checkpoint.py",
    "unit/checkpoint/test_lr_scheduler.py",
    "unit/checkpoint/test_zero_optimizer.py",
    "unit/utils/test_get_optim_files.py",
    "unit/runtime/zero/test_zero_tensor_fragment.py",
    "unit/v1/zero/test_zero.py",
]

INTERNAL_ATTR = re.compile(r"\b(ds_status|ds_tensor|ds_id|ds_numel|ds_shape|ds_persist|ds_summary|ds_external_"
                           r"|tput_timer|ds_grads_remaining|ds_active_sub_modules|partition_numel)\b")
PUBLIC_MODULES = ("deepspeed.utils.", "deepspeed.comm.", "deepspeed.zero.", "deepspeed.runtime.zero.")
# Names under deepspeed.runtime.zero that DeepSpeed documents for users (the rest is internal).
PUBLIC_ZERO = {"GatheredParameters", "Init", "register_external_parameter", "unregister_external_parameter",
               "unwrap_model_for_generation", "TiledLinear", "TiledLinearReturnBias"}


def classify(message: str) -> str:
    """Cause class of one failure from its message: what DeepSpeed name or behaviour it needed."""
    missing = MISSING.search(message)
    if missing:
        name = missing.group(1)
        if name.startswith("deepspeed.accelerator."):
            return "harness (accelerator)"
        parts = name.split(".")
        if name.startswith("deepspeed.runtime.zero."):
            return "missing public API" if parts[3] in PUBLIC_ZERO and len(parts) == 4 else "reads DeepSpeed internals"
        if len(parts) == 2 or (name.startswith(PUBLIC_MODULES) and len(parts) == 3):
            return "missing public API"
        return "reads DeepSpeed internals"
    if re.search(r"module 'shardwise[\w.]*' has no attribute", message):
        return "missing public API"
    if INTERNAL_ATTR.search(message) or re.search(r"'(Parameter|Adam\w*|SGD|\w*Optimizer\w*)' object has no "
                                                  r"attribute", message):
        return "reads DeepSpeed internals"
    if "cuda" in message.lower() or "nccl" in message.lower():
        return "needs CUDA"
    if "Test hanged" in message or "no junit" in message:
        return "hang/timeout"
    return "behaviour (triage)"


def stage(checkout: Path, out: Path) -> Path:
    """Copy the checkout's tests into ``out`` (fresh each run) and return the tests folder."""
    tests = out / "tests"
    if tests.exists():
        shutil.rmtree(tests)
    shutil.copytree(checkout / "tests", tests, ignore=shutil.ignore_patterns("__pycache__"))
    return tests


def write_hook(out: Path, repo: Path) -> Path:
    """The facade's PYTHONPATH hook, written by the shardwise tree under test."""
    res = subprocess.run([sys.executable, "-m", "shardwise.deepspeed", "hook", str(out / "hook")], check=True,
                         env=dict(os.environ, PYTHONPATH=str(repo)), capture_output=True, text=True)
    return Path(res.stdout.strip())


def run_file(tests: Path, rel: str, out: Path, timeout: int, extra: list[str], repo: Path) -> Path:
    xml = out / "junit" / (rel.replace("/", "__") + ".xml")
    xml.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=f"{out / 'hook'}{os.pathsep}{repo}", DS_UNITTEST_TIMEOUT=str(timeout),
               **HARNESS_ENV)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--color=no", "-q", "-rN",
           f"--junitxml={xml}", rel, *extra]
    log = out / "logs" / (rel.replace("/", "__") + ".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:
        subprocess.run(cmd, cwd=tests, env=env, stdout=fh, stderr=subprocess.STDOUT, check=False)
    return xml


def parse(xml: Path, rel: str) -> list[dict]:
    if not xml.exists():
        return [{"file": rel, "test": "<file>", "outcome": "error", "message": "no junit (hang?)",
                 "cause": "hang/timeout"}]
    rows = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = case.get("name", "")
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "failed" if tag == "failure" else tag
                message = (node.get("message") or "") + "\n" + (node.text or "")[-3000:]
                break
        row = {"file": rel, "test": f"{case.get('classname', '').split('.')[-1]}::{name}", "outcome": outcome,
               "message": message.strip()[:3000]}
        if outcome in ("failed", "error"):
            row["cause"] = classify(message)
        rows.append(row)
    return rows


def report(rows: list[dict], out: Path) -> str:
    by_file: dict[str, Counter] = {}
    for r in rows:
        by_file.setdefault(r["file"], Counter())[r["outcome"]] += 1
    lines = ["| file | tests | passed | failed | error | skipped |", "| --- | --- | --- | --- | --- | --- |"]
    total = Counter()
    for f, c in by_file.items():
        total.update(c)
        lines.append(f"| {f} | {sum(c.values())} | {c['passed']} | {c['failed']} | {c['error']} | {c['skipped']} |")
    lines.append(f"| **all** | {sum(total.values())} | {total['passed']} | {total['failed']} | {total['error']} "
                 f"| {total['skipped']} |")
    causes = Counter(r["cause"] for r in rows if "cause" in r)
    lines += ["", "| failure cause | tests |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in causes.most_common()]
    lines += ["", "## Failures", ""]
    for r in rows:
        if "cause" in r:
            first = r["message"].splitlines()[0][:200] if r["message"] else ""
            lines.append(f"- `{r['file']}::{r['test']}` ({r['cause']}): {first}")
    text = "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    return text


def from_junit(dirs: list[Path], out: Path) -> str:
    """Rebuild the report from earlier runs' junit files (a test run in several folders: the last
    folder's outcome counts; runs of parts of a file, e.g. with ``-k``, add up)."""
    by_test: dict[tuple[str, str], dict] = {}
    for d in dirs:
        for xml in sorted((d / "junit").glob("*.xml")):
            for r in parse(xml, xml.name[:-4].replace("__", "/")):
                by_test[(r["file"], r["test"])] = r
    rows = list(by_test.values())
    out.mkdir(parents=True, exist_ok=True)
    return report(rows, out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkout", type=Path, help="a DeepSpeed source checkout (holds tests/unit)")
    ap.add_argument("files", nargs="*", help="test files relative to tests/ (default: the public-API set)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/ds_conformance"), help="scratch folder")
    ap.add_argument("--timeout", type=int, default=300, help="per-test seconds before DeepSpeed's harness gives up")
    ap.add_argument("--repo", type=Path, default=REPO, help="the shardwise tree to test (default: this one)")
    ap.add_argument("--pytest", default="", help="extra pytest arguments, e.g. \"-k 'not nvme'\"")
    ap.add_argument("--from-junit", type=Path, nargs="+", metavar="DIR",
                    help="only rebuild report.md from these earlier --out folders (checkout then unused)")
    args = ap.parse_intermixed_args(argv)
    if args.from_junit:
        print(from_junit(args.from_junit, args.out))
        return 0
    if not (args.checkout / "tests" / "unit" / "common.py").exists():
        ap.error(f"{args.checkout} is not a DeepSpeed checkout (no tests/unit/common.py)")
    args.out.mkdir(parents=True, exist_ok=True)
    tests = stage(args.checkout, args.out)
    write_hook(args.out, args.repo.resolve())
    rows: list[dict] = []
    for rel in args.files or DEFAULT_FILES:
        xml = run_file(tests, rel, args.out, args.timeout, shlex.split(args.pytest), args.repo.resolve())
        rows += parse(xml, rel)
        c = Counter(r["outcome"] for r in rows if r["file"] == rel)
        print(f"{rel}: {dict(c)}", flush=True)
    print(report(rows, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
