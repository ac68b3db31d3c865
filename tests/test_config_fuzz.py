"""Property: any config (dict or file text) either loads or raises ConfigError naming a key or the file.

Configs are random trees built from the real key paths (DeepSpeed's and the schema's) with values of
every type, including wrong ones, non-finite floats, huge ints, strings that look like booleans, and
random keys and nesting. Bounded (tests/fuzz_budget.py: 400 and 200 examples in the suite, thousands
with ``SHARDWISE_FUZZ=long``), each within a peak-memory bound.
"""

import math
import warnings

from fuzz_budget import fuzz_settings, memory_bound
from hypothesis import given
from hypothesis import strategies as st

from shardwise.config import ConfigError, SupportedFeatures, load_config
from shardwise.config.keys import KEYS
from shardwise.config.read import read_config

PATHS = sorted({k.path for k in KEYS} | {
    "optimizer.type", "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.amsgrad",
    "scheduler.type", "scheduler.params.total_num_steps", "scheduler.params.warmup_max_lr",
    "zero_optimization.prefetch_bucket_size", "bfloat16.enabled"})
NAMES = sorted({p.split(".")[-1] for p in PATHS} | {"auto", "type", "params", "enabled"})

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 5), st.integers(min_value=-2**70, max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([math.inf, -math.inf, math.nan, 5e8, 1e400]),
    st.sampled_from(["auto", "false", "true", "0", "cpu", "nvme", "none", "fp16", "bf16", "fp32", "Adam",
                     "AdamW", "SGD", "Lamb", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", ""]),
    st.text(max_size=8))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(NAMES) | st.text(max_size=6), inner, max_size=4)),
    max_leaves=8)


@st.composite
def configs(draw) -> dict:
    """A dict holding a few real key paths (and some random keys) set to random values."""
    config: dict = {}
    for path in draw(st.lists(st.sampled_from(PATHS), max_size=8)):
        node = config
        parts = path.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        node[parts[-1]] = draw(values)
    for key, value in draw(st.dictionaries(st.sampled_from(NAMES) | st.text(max_size=6), values, max_size=2)).items():
        config.setdefault(key, value)
    return config


def _load(config, world_size: int) -> None:
    with warnings.catch_warnings(), memory_bound(what="load_config"):
        warnings.simplefilter("ignore", FutureWarning)  # deprecated aliases: a warning, not an outcome
        load_config(config, world_size=world_size,
                    supported=SupportedFeatures(stage3=True, tensor_parallel=True, offload_param=True))


@fuzz_settings(400)
@given(configs(), st.sampled_from([1, 2, 4]))
def test_random_configs_load_or_raise_config_error(config, world_size):
    try:
        _load(config, world_size)
    except ConfigError as exc:
        msg = str(exc)
        assert msg and ":" in msg.splitlines()[0], msg  # "key.path: what is wrong" (or a file/count header)


@fuzz_settings(200)
@given(st.one_of(st.text(max_size=200), st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
                 st.builds(lambda d, n: "{" * n + d + "}" * n, st.sampled_from(['"a": 1', "a: 1", ""]),
                           st.integers(0, 3000))))
def test_random_file_text_reads_or_raises_config_error(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("fuzz") / "c.json"
    path.write_text(text, encoding="utf-8")
    try:
        data = read_config(path)
    except ConfigError as exc:
        assert str(path) in str(exc)
        return
    assert isinstance(data, dict)
    try:
        _load(data, 1)
    except ConfigError:
        pass
