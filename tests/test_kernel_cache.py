"""The on-disk kernel cache on the CPU (marker `compile`: a small kernel compiled for sm_90a): a later process loads
what an earlier one compiled; an entry's name changes with everything that shapes the code; a damaged entry is
compiled again and replaced; a folder that cannot be written, or the cache turned off, costs only the time."""

from __future__ import annotations

import json
import os
import subprocess
import time
import sys

import pytest

from exl3tool.kernels import dequant
from exl3tool.kernels.dequant import DequantConfig
from exl3tool.ops import kernel_cache, launch, runtime
from exl3tool.ops.kernel_cache import CACHE_ENV, Counts, entry_name
from helpers import ROOT

pytestmark = pytest.mark.compile

ARCH = "sm_90a"
CONFIG = DequantConfig(4.0, "mcg")  # the quickest kernel to compile (0.15 s)
OPTIONS = f"{runtime.COMPILE_OPTIONS} --gpu-arch={ARCH}"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache folder, counts from zero, and no kernel compiled yet in this process."""
    folder = tmp_path / "kernels"
    monkeypatch.setenv(CACHE_ENV, str(folder))
    monkeypatch.setattr(kernel_cache, "counts", Counts())
    monkeypatch.setattr(runtime, "_cache", {})
    return folder


def compile_as_a_new_process(builds: list, config=CONFIG, key=None):
    """compile_cached (under ``key``, by default the launcher's) with this process's compiled kernels forgotten, as a
    new process starts; ``builds`` counts the compiles."""
    def build(options):
        builds.append(options)
        return launch.BUILDERS[type(config)](config, options)

    runtime._cache.clear()
    return runtime.compile_cached(key or (type(config).__name__, config), ARCH, build)


def entries(folder):
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_a_later_process_loads_what_an_earlier_one_compiled(cache):
    import tvm_ffi

    builds = []
    compile_as_a_new_process(builds)
    assert len(builds) == 1 and kernel_cache.counts == Counts(loaded=0, compiled=1, stored=1)
    name = entry_name((type(CONFIG).__name__, CONFIG, ARCH), OPTIONS)
    assert entries(cache) == [f"{name}.o"]  # the entry alone: no temporary file left beside it

    function = compile_as_a_new_process(builds)
    assert len(builds) == 1 and kernel_cache.counts == Counts(loaded=1, compiled=1, stored=1)
    assert isinstance(function, tvm_ffi.Function)

    # another interpreter (its own hash seed, its own imports) finds the same entry
    script = ("import json; from exl3tool.kernels.dequant import DequantConfig; "
              "from exl3tool.ops import kernel_cache, launch; "
              f"launch.compiled(DequantConfig(4.0, 'mcg'), '{ARCH}'); print(json.dumps(vars(kernel_cache.counts)))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "PYTHONHASHSEED": "random"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"loaded": 1, "compiled": 0, "stored": 0}
    assert entries(cache) == [f"{name}.o"]


def test_entry_names_change_with_what_shapes_the_code(monkeypatch):
    key = (type(CONFIG).__name__, CONFIG, ARCH)
    base = entry_name(key, OPTIONS)
    assert base == entry_name(key, OPTIONS) and base.startswith("k") and base[1:].isalnum()
    other_config = (type(CONFIG).__name__, DequantConfig(3.0, "mcg"), ARCH)
    other_arch = (type(CONFIG).__name__, CONFIG, "sm_120a")
    names = {entry_name(other_config, OPTIONS), entry_name(other_arch, OPTIONS.replace(ARCH, "sm_120a")),
             entry_name(key, OPTIONS + " --keep-ptx")}
    with monkeypatch.context() as patch:  # a switch the kernel reads as it is traced (as the A/B tool sets one)
        patch.setattr(dequant, "WARPS", dequant.WARPS * 2)
        names.add(entry_name(key, OPTIONS))
    assert entry_name(key, OPTIONS) == base
    with monkeypatch.context() as patch:  # an edit to any source
        patch.setattr(kernel_cache, "_sources", lambda: "edited")
        names.add(entry_name(key, OPTIONS))
    with monkeypatch.context() as patch:  # another CuTe DSL or TVM FFI
        patch.setattr(kernel_cache, "_toolchain", lambda: "cutlass-dsl 9.9")
        names.add(entry_name(key, OPTIONS))
    with monkeypatch.context() as patch:  # a setting of the DSL's own
        patch.setenv("CUTE_DSL_LINEINFO", "1")
        names.add(entry_name(key, OPTIONS))
    assert len(names) == 7 and base not in names


def test_a_key_without_stable_text_is_compiled_and_not_stored(cache):
    builds = []
    key = ("DequantConfig", CONFIG, object())  # its repr names an address, different in every process
    assert entry_name((*key, ARCH), OPTIONS) is None
    compile_as_a_new_process(builds, key=key)
    assert len(builds) == 1 and entries(cache) == [] and kernel_cache.counts.stored == 0


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_a_damaged_entry_is_compiled_again_and_replaced(cache, damage):
    builds = []
    compile_as_a_new_process(builds)
    [path] = cache.iterdir()
    whole = path.read_bytes()
    path.write_bytes({"garbage": b"not an object file" * 100, "truncated": whole[: len(whole) // 2],
                      "empty": b""}[damage])
    compile_as_a_new_process(builds)
    assert len(builds) == 2 and kernel_cache.counts.loaded == 0
    assert path.read_bytes() == whole  # replaced by the kernel compiled again
    compile_as_a_new_process(builds)
    assert len(builds) == 2 and kernel_cache.counts.loaded == 1


def test_a_folder_that_cannot_be_written_costs_only_the_time(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("in the folder's way")
    monkeypatch.setenv(CACHE_ENV, str(blocker / "kernels"))
    monkeypatch.setattr(kernel_cache, "counts", Counts())
    monkeypatch.setattr(runtime, "_cache", {})
    builds = []
    assert compile_as_a_new_process(builds) is not None
    compile_as_a_new_process(builds)
    assert len(builds) == 2 and kernel_cache.counts == Counts(loaded=0, compiled=2, stored=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_the_cache_turned_off_writes_nothing(cache, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, " OFF ")
    builds = []
    compile_as_a_new_process(builds)
    compile_as_a_new_process(builds)
    assert len(builds) == 2 and kernel_cache.counts == Counts(loaded=0, compiled=2, stored=0)
    assert not cache.exists()


def test_the_default_folder(monkeypatch, tmp_path):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kernel_cache.folder() == tmp_path / "exl3tool" / "kernels"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert kernel_cache.folder() == tmp_path / "home" / ".cache" / "exl3tool" / "kernels"
    monkeypatch.setenv(CACHE_ENV, "~/k")
    assert kernel_cache.folder() == tmp_path / "home" / "k"


def test_entries_unused_for_a_month_and_stale_temporaries_are_pruned(cache, monkeypatch):
    builds = []
    compile_as_a_new_process(builds)
    [used] = cache.iterdir()
    month = kernel_cache.UNUSED_DAYS * 86400
    old = time.time() - month - 3600
    os.utime(used, (old, old))
    compile_as_a_new_process(builds)  # a load marks the entry used
    assert len(builds) == 1 and time.time() - used.stat().st_mtime < 600
    stale, partial, fresh_partial = cache / ("k" + "0" * 40 + ".o"), cache / ".k1.abc.o", cache / ".k2.abc.o"
    for path, age in ((stale, month + 3600), (partial, 2 * 86400), (fresh_partial, 60)):
        path.write_bytes(b"x")
        os.utime(path, (time.time() - age, time.time() - age))
    monkeypatch.setattr(kernel_cache, "_pruned", set())  # as a new process: its first store prunes
    compile_as_a_new_process(builds, DequantConfig(3.0, "mcg"))
    assert len(builds) == 2
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [used.name, fresh_partial.name, entry_name(("DequantConfig", DequantConfig(3.0, "mcg"), ARCH), OPTIONS) + ".o"])


def test_no_home_folder_means_no_cache(monkeypatch):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

    def homeless():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(kernel_cache.Path, "home", staticmethod(homeless))
    assert kernel_cache.folder() is None

