"""The streaming JSONL reader (``train/jsonl_stream.py``): the same texts and refusals as
``json.loads`` line by line, in memory bounded by a chunk (issue 34: one 200 MB record grew memory by
12x the record)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import fresh_ranks
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardwise.train import jsonl_stream
from shardwise.train.data import DataError, read_documents

ROOT = Path(__file__).resolve().parent.parent
SCALE = int(os.environ.get("SHARDWISE_FUZZ_EXAMPLES", 100)) / 100
FUZZ = settings(max_examples=max(1, int(200 * SCALE)), deadline=None, derandomize=SCALE <= 1,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]) | st.sampled_from('"\\\n\t\x00/\u2028'),
               max_size=60)
VALUE = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT,
                     lambda v: st.lists(v, max_size=3) | st.dictionaries(TEXT, v, max_size=3), max_leaves=8)
RECORD = st.dictionaries(TEXT.filter(lambda k: k != "text"), VALUE, max_size=3).flatmap(
    lambda d: st.tuples(st.just(d), TEXT, st.integers(0, len(d)), st.booleans()))


def _line(rec) -> str:
    other, text, where, ascii_only = rec
    items = list(other.items())
    items.insert(where, ("text", text))
    return json.dumps(dict(items), ensure_ascii=ascii_only)


def _expected(path: Path) -> list[str] | str:
    """What json.loads line by line gives: the texts, or the first bad line number."""
    out = []
    for n, raw in enumerate(path.read_bytes().split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return f":{n}:"
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            return f":{n}:"
        out.append(obj["text"])
    return out


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of a few characters, so records, strings, escapes and UTF-8 characters are cut anywhere."""
    monkeypatch.setattr(jsonl_stream, "READ_BYTES", 7)
    monkeypatch.setattr(jsonl_stream, "PIECE_CHARS", 5)


@FUZZ
@given(st.lists(RECORD, min_size=1, max_size=4), st.lists(st.tuples(st.integers(0, 10**6), st.binary(max_size=3)),
                                                         max_size=2), st.sampled_from(["\n", "\r\n", "\n\n  \n"]))
def test_streamed_records_equal_json_loads(tmp_path, small_chunks, records, damage, sep):
    """Valid records (any keys, nested values, escapes, non-ASCII, the text anywhere in the object)
    give json.loads' texts; a damaged file is refused at json.loads' first bad line, or gives its
    texts when the damage left it valid. (Duplicate text keys are drawn out: json.loads keeps the
    last, the stream refuses them.)"""
    raw = bytearray(sep.join(_line(r) for r in records).encode() + b"\n")
    for pos, b in damage:
        i = pos % (len(raw) + 1)
        raw[i:i + len(b)] = b
    f = tmp_path / "d.jsonl"
    f.write_bytes(bytes(raw))
    want = _expected(f)
    try:
        got: list[str] | str = list(read_documents(f))
    except DataError as e:
        got = str(e)
        assert "\n" not in got and str(f) in got
        if "is given twice" in got:
            return
        assert isinstance(want, str) and want in got, (want, got, bytes(raw))
        return
    assert got == want, bytes(raw)


def test_messages_name_the_line(tmp_path):
    f = tmp_path / "docs.jsonl"
    f.write_text('{"text": "a"}\n\n{"text": "b", "text": "c"}\n')
    with pytest.raises(DataError, match=r"docs\.jsonl:3: the field \"text\" is given twice"):
        list(read_documents(f))
    f.write_text('{"text": "a"}\n{"text": 3}\n')
    with pytest.raises(DataError, match=r"docs\.jsonl:2: no string field \"text\" \(it is a int\)"):
        list(read_documents(f))
    f.write_text('{"text": "a"}\n{"text": "b"} x\n')
    with pytest.raises(DataError, match=r"docs\.jsonl:2: not a JSON object \(extra data"):
        list(read_documents(f))


@pytest.mark.subprocess
def test_a_48mb_record_is_read_in_bounded_memory(tmp_path):
    """Peak RSS growth of tokenizing a JSONL file whose one record holds 48 MiB of text (escapes
    included), byte tokenizer, in a process of its own (forked after the imports,
    tests/fresh_ranks.py): before, json.loads of the line and the whole string grew it by about 12x
    the record; now a few chunks."""
    big = tmp_path / "big.jsonl"
    with big.open("w") as f:
        f.write('{"id": 1, "text": "')
        for _ in range(48):
            f.write("lorem ipsum \\\"dolor\\\" sit\\n amet " * 29959)  # 1 MiB of escaped text
        f.write('", "meta": {"x": [1, 2]}}\n{"text": "end"}\n')
    rank = fresh_ranks.start("process_cases:tokenize_peak_growth", [str(big), str(tmp_path / "cache")],
                             {**os.environ, "OMP_NUM_THREADS": "1"}, tmp_path / "proc")
    assert rank.wait(timeout=300) == 0, rank.communicate()[1][-2000:]
    out = rank.communicate()[0]
    growth_mib = float(out.strip().splitlines()[-1])
    print(f"[measured] 48 MiB JSONL record: peak RSS growth {growth_mib:.0f} MiB")
    assert growth_mib < 100, f"tokenizing a 48 MiB record grew RSS by {growth_mib:.0f} MiB"
    text_chars = 48 * 29959 * len("lorem ipsum \"dolor\" sit\n amet ")
    meta = json.loads(next((tmp_path / "cache").glob("*.json")).read_text())
    assert meta["documents"] == 2 and meta["tokens"] == text_chars + 1 + 3 + 1  # byte tokens + separators
