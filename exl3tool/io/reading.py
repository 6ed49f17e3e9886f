"""Reading the files a checkpoint consists of, defensively: regular files only, every read bounded by what the
format allows, JSON as RFC 8259 defines it. A checkpoint may be hostile; none of this may hang, exhaust memory
or raise anything but UnreadableInputError.

    open_regular(path, display) -> fd            a regular file (a FIFO, device, folder or loop is refused, and
                                                 opening never blocks)
    read_bounded(path, display, limit) -> bytes  the whole file, refused when larger than `limit`
    kind_of(path) -> str | None                  why `path` is not a readable regular file ('missing', 'a FIFO,
                                                 not a regular file', 'a symlink loop', ...), None when it is
    loads_strict(raw, display) -> object         JSON without NaN/Infinity, out-of-range numbers or deep nesting
    brief(value) -> str                          a JSON value, short enough for a one-line message
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat

from exl3tool.errors import UnreadableInputError

MAX_JSON_BYTES = 256 << 20  # config.json, the index, manifest.json: real ones are kilobytes to tens of MB
MAX_JSON_DEPTH = 64  # real configs nest a handful of levels; deeper is hostile (and would overflow the stack)

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _special(mode: int) -> str | None:
    if stat.S_ISREG(mode):
        return None
    return f"{next((name for test, name in _KINDS if test(mode)), 'a special file')}, not a regular file"


def _os_reason(error: OSError, path) -> str:
    if error.errno == errno.ENOENT:
        return "a symlink to a missing file" if os.path.islink(path) else "missing"
    if error.errno == errno.ELOOP:
        return "a symlink loop"
    return f"cannot read: {error.strerror or error}"


def kind_of(path) -> str | None:
    """None for a regular file (symlinks followed), else why not: 'missing', 'a FIFO, not a regular file', ..."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        return _os_reason(e, path)
    except ValueError:  # a NUL byte in the name
        return "not a valid file name"
    return _special(mode)


def open_regular(path, display: str) -> int:
    """A read-only descriptor of the regular file `path`; UnreadableInputError naming `display` otherwise.
    O_NONBLOCK: opening a FIFO would otherwise wait for a writer forever (it is a no-op for regular files)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise UnreadableInputError(_os_reason(e, path), path=display) from None
    except ValueError:
        raise UnreadableInputError("not a valid file name", path=display) from None
    kind = _special(os.fstat(fd).st_mode)
    if kind is not None:
        os.close(fd)
        raise UnreadableInputError(kind, path=display)
    return fd


def read_bounded(path, display: str, limit: int = MAX_JSON_BYTES) -> bytes:
    """All of the regular file `path`, at most `limit` bytes (a larger file is refused before reading)."""
    fd = open_regular(path, display)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise UnreadableInputError(f"{size} bytes: larger than the {limit} such a file can be", path=display)
        chunks, left = [], size
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError as e:
        raise UnreadableInputError(f"cannot read: {e.strerror or e}", path=display) from None
    finally:
        os.close(fd)


def _constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:30]} is out of range")
    return value


def _check_depth(data: object, display: str) -> None:
    """Iteratively (a recursive walk is what a hostile file would overflow)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise UnreadableInputError(f"malformed JSON: nested deeper than {MAX_JSON_DEPTH} levels", path=display)
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values() if isinstance(v, (dict, list)))
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value if isinstance(v, (dict, list)))


def loads_strict(raw: bytes | str, display: str, check_depth: bool = True) -> object:
    """Parse JSON strictly; UnreadableInputError ('malformed JSON: ...') naming `display` for anything else."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray, memoryview)) else raw
        data = json.loads(text, parse_constant=_constant, parse_float=_finite)
    except RecursionError:
        raise UnreadableInputError("malformed JSON: nested too deeply", path=display) from None
    except UnicodeDecodeError as e:
        raise UnreadableInputError(f"malformed JSON: not UTF-8 ({e.reason} at byte {e.start})", path=display) from None
    except ValueError as e:
        raise UnreadableInputError(f"malformed JSON: {e}", path=display) from None
    if check_depth:
        _check_depth(data, display)
    return data


def brief(value: object, limit: int = 60) -> str:
    """A JSON value for a one-line message: its repr when short and flat (cut to `limit`), else its kind and
    size (never a recursive repr: a hostile value may be nested thousands deep)."""
    flat = not isinstance(value, (dict, list)) or (
        isinstance(value, list) and len(value) <= 8 and not any(isinstance(v, (dict, list)) for v in value))
    if not flat:
        return f"an object of {len(value)} key(s)" if isinstance(value, dict) else f"a list of {len(value)} item(s)"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
