# The by-value codec between a test driver and the candidate it grades (and the host's call-case
# driver): plain data only, as tagged JSON, so that a value crossing the pipe is rebuilt from
# builtin types on the other side and nothing the candidate defined (a lying __eq__, a str
# subclass, a generator) ever reaches the code that decides pass or fail.
#
# This file is both a module of the engine (workers.sandbox.harness.wire) and the first part of
# the Python bootstrap's source (runner.py prepends it), so it imports nothing at module level:
# every sandbox pays for what the bootstrap imports, and `json` costs ~13 ms (it imports `re`).
# `_json` (the C scanner and string escaper behind `json`) is loaded only when a value is coded.
#
# Encoding: null/true/false/numbers/strings as JSON (finite floats by repr, so 1.0 stays a
# float and round-trips exactly); lists as arrays; everything else is a one-key object:
#   {"$t": [...]} tuple, {"$s": [...]} set, {"$fs": [...]} frozenset, {"$d": [[k, v], ...]} dict,
#   {"$b": "<hex>"} bytes, {"$f": "nan" | "inf" | "-inf"} float, {"$c": [re, im]} complex,
#   {"$u": null} JavaScript undefined (decoded as None here).
# A JSON object without exactly one known tag is malformed. Frames on the pipe are a 4-byte
# big-endian length followed by that many bytes of JSON (ASCII from Python and Node; other call
# servers may send UTF-8), WIRE_MAX bytes at most.

WIRE_MAX = 16 << 20
WIRE_DEPTH = 200


class WireError(ValueError):
    """A value that cannot cross by value, or a malformed message."""


_TAGS = ("$t", "$s", "$fs", "$d", "$b", "$f", "$c", "$u")
_scanner = None


def _hook(obj):
    if len(obj) != 1:
        raise WireError("a wire object has exactly one tag")
    (tag, body), = obj.items()
    if tag == "$t" and type(body) is list:
        return tuple(body)
    if tag == "$s" and type(body) is list:
        return set(body)
    if tag == "$fs" and type(body) is list:
        return frozenset(body)
    if tag == "$d" and type(body) is list:
        out = {}
        for pair in body:
            if type(pair) is not list or len(pair) != 2:
                raise WireError("a dict item is a [key, value] pair")
            out[pair[0]] = pair[1]
        return out
    if tag == "$b" and type(body) is str:
        return bytes.fromhex(body)
    if tag == "$f" and body in ("nan", "inf", "-inf"):
        return float(body)
    if tag == "$c" and type(body) is list and len(body) == 2:
        return complex(float(body[0]), float(body[1]))
    if tag == "$u" and body is None:
        return None
    raise WireError(f"unknown wire tag {tag!r}")


def _no_constant(name):
    raise WireError(f"bare {name} is not allowed (floats that are not finite are tagged)")


class _Context:
    """What _json.make_scanner reads from a JSONDecoder: strict strings, our object hook."""

    strict = True
    object_hook = staticmethod(_hook)
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = staticmethod(_no_constant)
    memo = {}


def loads(data):
    """bytes or str of one JSON document -> plain Python value; WireError if malformed."""
    global _scanner
    if _scanner is None:
        import _json

        _scanner = _json.make_scanner(_Context())
    text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
    try:
        value, end = _scanner(text, 0)
    except WireError:
        raise
    except StopIteration as exc:
        raise WireError("not a JSON document") from exc
    except (ValueError, TypeError, RecursionError, MemoryError, UnicodeError) as exc:
        raise WireError(f"malformed wire value: {type(exc).__name__}") from exc
    if text[end:].strip():
        raise WireError("trailing data after the wire value")
    return value


def dumps(value):
    """Plain Python value -> ASCII JSON text; WireError for anything that is not plain data."""
    import _json

    out = []
    _encode(value, out, _json.encode_basestring_ascii, 0)
    return "".join(out)


def _encode(v, out, esc, depth):
    if depth > WIRE_DEPTH:
        raise WireError("value nested too deeply to send")
    # bool before int (bool is an int); isinstance, so an IntEnum or a str subclass crosses as
    # its plain value (int.__repr__ and friends never call the subclass's own methods).
    if v is None:
        out.append("null")
    elif v is True:
        out.append("true")
    elif v is False:
        out.append("false")
    elif isinstance(v, int):
        out.append(int.__repr__(v))
    elif isinstance(v, float):
        if v != v or v in (float("inf"), float("-inf")):
            out.append('{"$f":"' + ("nan" if v != v else "inf" if v > 0 else "-inf") + '"}')
        else:
            out.append(float.__repr__(v))
    elif isinstance(v, str):
        out.append(esc(str.__str__(v)))
    elif isinstance(v, (list, tuple, set, frozenset)):
        if isinstance(v, list):
            head, items = "[", list.__iter__(v)
        elif isinstance(v, tuple):
            head, items = '{"$t":[', tuple.__iter__(v)
        elif isinstance(v, frozenset):
            head, items = '{"$fs":[', frozenset.__iter__(v)
        else:
            head, items = '{"$s":[', set.__iter__(v)
        out.append(head)
        first = True
        for item in items:
            if not first:
                out.append(",")
            first = False
            _encode(item, out, esc, depth + 1)
        out.append("]" if head == "[" else "]}")
    elif isinstance(v, dict):
        out.append('{"$d":[')
        first = True
        for key, item in dict.items(v):
            if not first:
                out.append(",")
            first = False
            out.append("[")
            _encode(key, out, esc, depth + 1)
            out.append(",")
            _encode(item, out, esc, depth + 1)
            out.append("]")
        out.append("]}")
    elif isinstance(v, (bytes, bytearray)):
        out.append('{"$b":"' + bytes(v).hex() + '"}')
    elif isinstance(v, complex):
        out.append('{"$c":[')
        _encode(v.real, out, esc, depth + 1)
        out.append(",")
        _encode(v.imag, out, esc, depth + 1)
        out.append("]}")
    else:
        raise WireError(f"a {type(v).__name__} cannot be passed by value")


def read_frame(fd, read):
    """One frame's bytes from `fd` through `read(fd, n)` (posix.read or os.read); None at a
    clean end of file; WireError for a truncated or oversized frame."""
    head = _read_exactly(fd, 4, read)
    if head is None:
        return None
    size = int.from_bytes(head, "big")
    if size > WIRE_MAX:
        raise WireError(f"frame of {size} bytes exceeds {WIRE_MAX}")
    body = _read_exactly(fd, size, read) if size else b""
    if body is None:
        raise WireError("the other side closed the pipe in the middle of a frame")
    return body


def _read_exactly(fd, n, read):
    chunks = []
    got = 0
    while got < n:
        chunk = read(fd, min(n - got, 1 << 20))
        if not chunk:
            if got == 0:
                return None
            raise WireError("the other side closed the pipe in the middle of a frame")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def frame(text):
    """The frame carrying `text` (ASCII JSON)."""
    data = text.encode("ascii")
    if len(data) > WIRE_MAX:
        raise WireError(f"message of {len(data)} bytes exceeds {WIRE_MAX}")
    return len(data).to_bytes(4, "big") + data
