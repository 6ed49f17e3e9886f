"""The on-disk cache of compiled kernels: a later process loads a kernel (tens of milliseconds) instead of compiling
it again (0.3-3 s each, and `exl3tool verify` or `bench` compiles a dozen or more).

An entry is one kernel's host and device code as one object file, written by the CuTe DSL's ahead-of-time export
(``export_to_c``) and read back by ``cute.runtime.load_module``: the same TVM FFI function a compile in this process
gives. Its name is a digest of everything that shapes the code: the compile cache's key (kernel, config, arch), the
compile options, the CuTe DSL and TVM FFI versions and ``CUTE_DSL_*`` settings, the exl3tool sources
(``version.source_digest``) and the value of every upper-case constant of the ``exl3tool.kernels`` and ``exl3tool.ops``
modules (the switches the A/B tool and the tests set). An entry is written whole (a temporary file renamed into place),
so no reader sees half of one; one that does not load is compiled again and replaced. The cache only saves time: a
folder that cannot be written leaves the kernel compiled in this process in use. A load marks its entry used (its
mtime), and the first store of a process in a folder deletes the entries unused for ``UNUSED_DAYS`` (the sources' edits
leave old ones behind) and the temporary files of processes killed while writing.

``EXL3TOOL_KERNEL_CACHE`` names the folder, or is ``off``; by default ``$XDG_CACHE_HOME/exl3tool/kernels``, else
``~/.cache/exl3tool/kernels``. Deleting the folder is always safe.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import importlib
import os
import pkgutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from exl3tool.version import source_digest

CACHE_ENV = "EXL3TOOL_KERNEL_CACHE"
OFF = "off"
# packages whose upper-case module constants enter every entry's name (kernel code reads them as it is traced)
SWITCH_PACKAGES = ("exl3tool.kernels", "exl3tool.ops")
UNUSED_DAYS = 30  # entries neither written nor loaded for this long are deleted


@dataclasses.dataclass
class Counts:
    """Kernels this process loaded from the cache and compiled (and wrote there, where it could)."""

    loaded: int = 0
    compiled: int = 0
    stored: int = 0


counts = Counts()
_pruned: set[Path] = set()  # the folders this process pruned (each once, at its first store there)


def folder() -> Path | None:
    """The cache folder, or None when ``EXL3TOOL_KERNEL_CACHE=off`` (or there is no home folder to put it in)."""
    setting = os.environ.get(CACHE_ENV, "").strip()
    if setting.lower() == OFF:
        return None
    try:
        if setting:
            return Path(setting).expanduser()
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "exl3tool" / "kernels"
    except RuntimeError:  # no home folder to expand (a service account without one): no cache
        return None


def entry_name(key: tuple, options: str) -> str | None:
    """The file stem of a kernel's entry, or None where the key has no stable text (an object's address in it)."""
    text = repr(key)
    if " at 0x" in text:
        return None
    dsl_settings = sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("CUTE_DSL_"))
    material = "\0".join((text, options, _toolchain(), *dsl_settings, _sources(), switches()))
    return "k" + hashlib.sha256(material.encode()).hexdigest()[:40]


def load(name: str) -> Any | None:
    """The kernel stored under ``name``, or None (no entry, no cache, or an entry that does not load)."""
    where = folder()
    path = where / f"{name}.o" if where is not None else None
    if path is None or not path.is_file():
        return None
    try:
        from cutlass.cute.runtime import load_module

        function = load_module(str(path), enable_tvm_ffi=True)[name]
    except Exception:  # a damaged or foreign entry: compile again, and the store replaces it
        return None
    counts.loaded += 1
    try:
        os.utime(path)  # used: kept by the pruning
    except OSError:
        pass
    return function


def store(name: str, compiled: Any) -> None:
    """Write a compiled kernel under ``name``; a folder that cannot be written is skipped (the kernel still runs)."""
    where = folder()
    if where is None:
        return
    temporary = None
    try:
        where.mkdir(parents=True, exist_ok=True)
        if where not in _pruned:
            _pruned.add(where)
            prune(where)
        handle, temporary = tempfile.mkstemp(dir=where, prefix=f".{name}.", suffix=".o")
        os.close(handle)
        os.chmod(temporary, 0o644)  # readable by all, as an ordinary file (mkstemp's is the owner's alone)
        compiled.export_to_c(temporary, function_name=name)
        os.replace(temporary, where / f"{name}.o")
        temporary = None
        counts.stored += 1
    except Exception:  # no permission, a full disk, a file in the folder's place: the cache only saves time
        pass
    finally:
        if temporary is not None and os.path.exists(temporary):
            os.unlink(temporary)


def keyed_switch(module: str, attr: str, value: Any) -> bool:
    """Whether ``module.attr = value`` enters the entry names: a process that sets anything else that shapes a
    kernel must turn the cache off."""
    inside = any(module == p or module.startswith(p + ".") for p in SWITCH_PACKAGES)
    return inside and attr.isupper() and _stable_text(value) is not None


def prune(where: Path, now: float | None = None) -> None:
    """Delete the entries unused for ``UNUSED_DAYS`` and the temporary files older than a day."""
    now = time.time() if now is None else now
    for path in where.iterdir():
        entry = path.name.startswith("k") and path.suffix == ".o"
        partial = path.name.startswith(".k") and path.suffix == ".o"
        try:
            age = now - path.stat().st_mtime
            if (entry and age > UNUSED_DAYS * 86400) or (partial and age > 86400):
                path.unlink()
        except OSError:  # another process took it first, or no permission: it stays
            pass


def switches() -> str:
    """Every upper-case constant of the kernel and host modules with a plain value, as stable text."""
    found = []
    for package in SWITCH_PACKAGES:
        for module in _modules(package):
            for attr, value in sorted(vars(module).items()):
                text = _stable_text(value) if attr.isupper() else None
                if text is not None:
                    found.append(f"{module.__name__}.{attr}={text}")
    return "\n".join(found)


@functools.lru_cache(maxsize=None)
def _module_names(package: str) -> tuple[str, ...]:
    root = importlib.import_module(package)
    return (package, *(f"{package}.{m.name}" for m in pkgutil.iter_modules(root.__path__)))


def _modules(package: str):
    """Every module of ``package`` (imported here, so that the text does not depend on what the caller imported)."""
    for name in _module_names(package):
        yield sys.modules.get(name) or importlib.import_module(name)


def _stable_text(value: Any) -> str | None:
    """``value`` as text that is the same in every process (sets sorted), or None if it is not plain data."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return repr(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, (tuple, list)):
        parts = [_stable_text(v) for v in value]
        return None if None in parts else "(" + ",".join(parts) + ")"
    if isinstance(value, (set, frozenset)):
        parts = [_stable_text(v) for v in value]
        return None if None in parts else "{" + ",".join(sorted(parts)) + "}"
    if isinstance(value, dict):
        parts = [(_stable_text(k), _stable_text(v)) for k, v in value.items()]
        if any(k is None or v is None for k, v in parts):
            return None
        return "{" + ",".join(sorted(f"{k}:{v}" for k, v in parts)) + "}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        inner = _stable_text(dataclasses.astuple(value))
        return None if inner is None else type(value).__name__ + inner
    return None


@functools.lru_cache(maxsize=None)
def _sources() -> str:
    return source_digest()


@functools.lru_cache(maxsize=None)
def _toolchain() -> str:
    import cutlass
    import tvm_ffi

    return f"cutlass-dsl {cutlass.__version__} tvm-ffi {tvm_ffi.__version__} {sys.platform}"
