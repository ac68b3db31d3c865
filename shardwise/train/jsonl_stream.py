"""Read the text field of each JSONL record as a stream of pieces, in memory bounded by a chunk.

``json.loads`` of one line holds the raw line, the decoded object and then the tokenizer's whole
input: a 200 MB record grew memory by 2.3 GB. Here the file is decoded ``READ_BYTES`` at a time and
each record is scanned as JSON: keys are read whole (they are short), the ``text_key`` string is
decoded (escapes and surrogate pairs included) and handed on in pieces of about ``PIECE_CHARS``
characters while it is being read, and every other value is checked and skipped (one small enough
is parsed by ``json.loads``; a larger one is scanned for its structure only). So memory is bounded by
a read chunk plus a piece, whatever the size of a record.

A record must be one JSON object on one line (JSON Lines); blank lines are skipped. Refused, by
line number: a line that is not an object, bad JSON in the object, a missing or non-string text
field, and the text field given twice (``json.loads`` would silently keep the last one).
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable, Iterator
from typing import BinaryIO

READ_BYTES = 1 << 20  # bytes decoded at a time
PIECE_CHARS = 1 << 20  # characters of text handed on at a time
SMALL_VALUE = 1 << 16  # other values up to this many characters are parsed whole (validated exactly)
_PLAIN = re.compile(r'[^"\\\x00-\x1f]*')
_WS = re.compile(r"[ \t\r]*")
_ATOM = re.compile(r"[^\s,\]}]*")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}

ErrorFactory = Callable[[int, str], Exception]


class _Scanner:
    """The decoded text of a binary file, a window at a time; ``line`` is the current line number."""

    def __init__(self, f: BinaryIO, error: ErrorFactory):
        self.f, self.error = f, error
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.buf, self.pos, self.eof, self.line = "", 0, False, 1
        self.bad_line = 0  # the line of the first byte that is not UTF-8, once read

    def fail(self, msg: str) -> Exception:
        return self.error(self.line, msg)

    def fill(self, size: int = 0, ahead: bool = False) -> bool:
        """Append the next decoded chunk; False at the end of the file. Bytes that are not UTF-8
        are refused when the reader reaches them, naming their line (the text before them is
        read first, as a line-by-line reader would)."""
        while True:
            if self.bad_line:
                if ahead:  # a read-ahead stops before them: they are refused when the parser reaches them
                    return False
                raise self.error(self.bad_line, "not UTF-8 text")
            if self.eof:
                return False
            raw = self.f.read(max(size, READ_BYTES))
            pending = self.decoder.getstate()[0]  # a character cut by the previous read
            try:
                text = self.decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as e:  # e.start counts from the pending bytes
                text = (pending + raw)[:e.start].decode("utf-8", errors="ignore")
                self.bad_line = self.line + self.buf.count("\n", self.pos) + text.count("\n")
            self.eof = not raw
            if text:
                self.buf, self.pos = self.buf[self.pos:] + text, 0
                return True

    def peek(self) -> str:
        """The next character ("" at the end of the file), not consumed."""
        while self.pos >= len(self.buf):
            if not self.fill():
                return ""
        return self.buf[self.pos]

    def need(self, n: int) -> str:
        """The next ``n`` characters (fewer only at the end of the file), not consumed."""
        while len(self.buf) - self.pos < n and self.fill(n - len(self.buf) + self.pos, ahead=True):
            pass
        return self.buf[self.pos:self.pos + n]

    def ws(self) -> None:
        while True:
            self.pos = _WS.match(self.buf, self.pos).end()
            if self.pos < len(self.buf) or not self.fill():
                return

    def expect(self, chars: str, what: str) -> str:
        self.ws()
        c = self.peek()
        if not c or c not in chars:
            found = "the end of the line" if c in ("", "\n") else repr(c)
            raise self.fail(f"not a JSON object (expected {what}, found {found})")
        self.pos += 1
        return c

    def _escape(self) -> str:
        """One escape sequence (the backslash at ``pos``), decoded; a surrogate pair as one character."""
        esc = self.need(2)[1:]
        if esc in _ESCAPES:
            self.pos += 2
            return _ESCAPES[esc]
        code = self._hex(self.need(6))
        self.pos += 6
        if 0xD800 <= code < 0xDC00 and self.need(2) == "\\u":
            low = self._hex(self.need(6))
            if 0xDC00 <= low < 0xE000:
                self.pos += 6
                return chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00))
        return chr(code)

    def _hex(self, seq: str) -> int:
        if len(seq) != 6 or seq[1] != "u" or not re.fullmatch(r"[0-9a-fA-F]{4}", seq[2:]):
            raise self.fail(f"not a JSON object (invalid escape {seq[:6]!r})")
        return int(seq[2:], 16)

    def string(self, limit: int = PIECE_CHARS) -> Iterator[str]:
        """The decoded content of the string whose opening quote was just consumed, in pieces of
        about ``limit`` characters; consumes the closing quote."""
        out: list[str] = []
        size = 0
        while True:
            m = _PLAIN.match(self.buf, self.pos)
            if m.end() > self.pos:
                out.append(m.group())
                size += m.end() - self.pos
                self.pos = m.end()
            if self.pos >= len(self.buf):
                if not self.fill():
                    raise self.fail("not a JSON object (a string is not closed)")
            elif self.buf[self.pos] == '"':
                self.pos += 1
                if out:
                    yield "".join(out)
                return
            elif self.buf[self.pos] == "\\":
                out.append(self._escape())
                size += 1
            else:
                what = "the line ends inside a string" if self.buf[self.pos] == "\n" else "a control character"
                raise self.fail(f"not a JSON object ({what})")
            if size >= limit:
                yield "".join(out)
                out, size = [], 0

    def skip_value(self) -> str:
        """Consume one JSON value; returns the type name json.loads would give it (for messages)."""
        self.ws()
        c = self.peek()
        if c == '"':
            self.pos += 1
            for _ in self.string():
                pass
            return "str"
        if c in "{[":
            return self._skip_container()
        m = _ATOM.match(self.buf, self.pos)
        while m.end() == len(self.buf) and m.end() - self.pos < SMALL_VALUE and self.fill():
            m = _ATOM.match(self.buf, self.pos)
        try:
            value = json.loads(m.group())
        except json.JSONDecodeError:
            raise self.fail(f"not a JSON object (bad value {m.group()[:20]!r})") from None
        self.pos = m.end()
        return type(value).__name__

    def _skip_container(self) -> str:
        """An object or array: parsed whole by json.loads when short, else scanned for structure."""
        kind = "dict" if self.peek() == "{" else "list"
        head = self.need(SMALL_VALUE)
        nl = head.find("\n")
        try:
            _, end = json.JSONDecoder().raw_decode(head if nl < 0 else head[:nl])
        except json.JSONDecodeError:
            if nl >= 0 or len(head) < SMALL_VALUE:  # the whole rest of the line was there: bad JSON
                raise self.fail("not a JSON object (bad value in the object)") from None
        else:
            self.pos += end
            return kind
        depth = 0
        while True:
            c = self.peek()
            if c in ("", "\n"):
                raise self.fail("not a JSON object (the line ends inside a value)")
            self.pos += 1
            if c == '"':
                for _ in self.string():
                    pass
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return kind


def _key(s: _Scanner) -> str:
    """A key, whole up to 4096 characters; a longer one is cut and marked, so it never equals the
    text field's name (a --text-key that long is not supported)."""
    parts, n = [], 0
    for piece in s.string(limit=4096):
        if n < 4096:
            parts.append(piece[:4096 - n])
        n += len(piece)
    return "".join(parts) + ("\0" if n > 4096 else "")


def _record(s: _Scanner, text_key: str) -> Iterator[str]:
    """The pieces of one record's text field; the whole record is checked before this ends."""
    first = s.peek()
    if first != "{":
        raise s.fail(f"not a JSON object (it starts with {first!r})")
    s.pos += 1
    keys: list[str] = []
    found = False
    s.ws()
    if s.peek() == "}":
        s.pos += 1
    else:
        while True:
            s.expect('"', "a key")
            key = _key(s)
            keys.append(key[:100])
            s.expect(":", "':'")
            s.ws()
            if key == text_key and found:
                raise s.fail(f"the field \"{text_key}\" is given twice")
            if key == text_key and s.peek() == '"':
                s.pos += 1
                found = True
                yield from s.string()
            elif key == text_key:
                raise s.fail(f"no string field \"{text_key}\" (it is a {s.skip_value()}); fix the line or "
                             "pass --text-key")
            else:
                s.skip_value()
            if s.expect(",}", "',' or '}'") == "}":
                break
    s.ws()
    if s.peek() not in ("", "\n"):
        raise s.fail(f"not a JSON object (extra data after the object: {s.peek()!r})")
    if not found:
        raise s.fail(f"no string field \"{text_key}\" (found {sorted(keys)}); fix the line or pass --text-key")


def jsonl_texts(f: BinaryIO, text_key: str, error: ErrorFactory) -> Iterator[Iterator[str]]:
    """Per record of the open JSONL file ``f``, an iterator of its ``text_key`` string in pieces.

    Each record's iterator must be consumed before the next is asked for (the next request
    finishes it if not). ``error(line, message)`` builds the exception raised for a bad line.
    """
    s = _Scanner(f, error)
    while True:
        while True:  # blank lines and the newline that ends a record
            s.ws()
            c = s.peek()
            if c != "\n":
                break
            s.pos += 1
            s.line += 1
        if c == "":
            return
        record = _record(s, text_key)
        yield record
        for _ in record:  # finish the record (and its checks) if the caller did not
            pass
