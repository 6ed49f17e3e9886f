"""`prepare` is atomic and resumable: a killed run leaves nothing that looks complete, a re-run finishes only what
is missing and ends byte-identical to a clean run; OUT from another source or other options is refused unless
--overwrite; foreign files are never touched."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from exl3tool.errors import UnreadableInputError, UsageError
from exl3tool.prepared import is_prepared, load_prepared, prepare_checkpoint
from exl3tool.synthetic import ModelSpec, write_checkpoint

from helpers import ROOT, model_dir, run_cli

STATE = ".exl3tool-prepare"
SPEC = ModelSpec(arch="qwen3_moe", hidden=256, moe_intermediate=128, num_experts=4, num_layers=4, vocab=384)

# Killed by SIGKILL from inside its own progress callback: a real kill at an exact point of the run.
KILLER = textwrap.dedent("""
    import os, signal, sys
    from exl3tool.prepared import prepare_checkpoint
    src, out, unit, chunk, shard = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    seen = {}
    def progress(p):
        if p.unit == unit and not p.skipped and p.units_done < p.units_total:
            seen[unit] = seen.get(unit, 0) + 1
            if seen[unit] == chunk:
                os.kill(os.getpid(), signal.SIGKILL)
    prepare_checkpoint(src, out, max_shard_bytes=shard, progress=progress)
    print("not killed")
""")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("src") / "model", SPEC)


@pytest.fixture(scope="module")
def other_source(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("src2") / "model", SPEC, seed=7)


def units_of(out: Path) -> list[dict]:
    return json.loads((out / "manifest.json").read_text())["units"]


def listing(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir())


def kill_at(source: Path, out: Path, unit: str, chunk: int, shard: str = "2GB") -> None:
    done = subprocess.run([sys.executable, "-c", KILLER, str(source), str(out), unit, str(chunk), shard],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr


def assert_incomplete(out: Path) -> None:
    assert not (out / "manifest.json").exists() and not is_prepared(out)
    with pytest.raises(UnreadableInputError, match="incomplete"):
        load_prepared(out)


@pytest.mark.parametrize("unit, chunk, shard, fragments, leftover", [
    # killed inside the first shard of layer 2: a temp file, no final name for it
    ("layer-00002", 20, "2GB", ["layer-00000", "layer-00001"], []),
    # killed in layer 1 after some of its shards were renamed into place, before its fragment
    ("layer-00001", 30, "20kB", ["layer-00000"], ["layer-00001-p0.safetensors"]),
])
def test_killed_run_is_incomplete_and_resumes(tmp_path, source, unit, chunk, shard, fragments, leftover):
    out = tmp_path / "out"
    kill_at(source, out, unit, chunk, shard)
    assert_incomplete(out)
    state = sorted(p.name for p in (out / STATE).iterdir())
    assert [n for n in state if n.startswith("unit-")] == [f"unit-{u}.json" for u in fragments]
    assert any(n.endswith(".tmp") for n in state), state  # it died mid-write
    assert all(n in listing(out) for n in leftover)

    result = run_cli("prepare", source, out, "--max-shard-size", shard, "-f", "json")
    assert result.exit_code == 0, result.stderr
    report = result.json()
    counts = (report["units"], report["units_skipped"], report["units_written"])
    assert counts == (5, len(fragments), 5 - len(fragments))
    assert report["resumed"] is True and report["up_to_date"] is False
    assert STATE not in listing(out)
    fresh = tmp_path / "fresh"
    prepare_checkpoint(source, fresh, max_shard_bytes=shard)
    assert units_of(out) == units_of(fresh)  # same files, sizes and sha256: byte-identical output
    assert listing(out) == listing(fresh)
    with load_prepared(out) as p:  # every hash verified
        assert len(p.layers) == 4


def test_cli_killed_from_outside_then_resumed(tmp_path, source):
    """SIGKILL to the real CLI process as soon as its first unit is done (1 kB shards: one fsync per tensor)."""
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "exl3tool", "prepare", str(source), str(out), "-q",
                             "--max-shard-size", "1kB"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (out / STATE / "unit-layer-00000.json").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if (out / "manifest.json").exists():
        pytest.skip("the run finished before it could be killed")
    assert_incomplete(out)
    report = run_cli("prepare", source, out, "--max-shard-size", "1kB", "-f", "json").json()
    assert report["units_skipped"] >= 1 and report["units_written"] + report["units_skipped"] == 5
    fresh = tmp_path / "fresh"
    prepare_checkpoint(source, fresh, max_shard_bytes="1kB")
    assert units_of(out) == units_of(fresh)


def test_interrupt_cleans_temp_files_and_resumes(tmp_path, source, monkeypatch):
    """Ctrl-C in the CLI: exit 130, no temp file left, the lock released; the same command then finishes."""
    import exl3tool.cli.prepare as command

    real = command.prepare_checkpoint

    def interrupted(*args, progress=None, **kwargs):
        def stop(p):
            if p.unit == "layer-00001" and p.bytes_written:
                raise KeyboardInterrupt
        return real(*args, progress=stop, **kwargs)

    out = tmp_path / "out"
    monkeypatch.setattr(command, "prepare_checkpoint", interrupted)
    result = run_cli("prepare", source, out)
    assert result.exit_code == 130 and "interrupted" in result.stderr
    assert_incomplete(out)
    assert not [p for p in (out / STATE).iterdir() if p.name.endswith(".tmp")]
    monkeypatch.setattr(command, "prepare_checkpoint", real)
    report = run_cli("prepare", source, out, "-f", "json").json()
    assert (report["units_skipped"], report["units_written"]) == (1, 4)


def test_complete_output_is_left_alone(tmp_path, source):
    out = tmp_path / "out"
    prepare_checkpoint(source, out)
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    report = prepare_checkpoint(source, out)
    assert report.up_to_date and report.units_written == 0 and report.bytes_written == 0
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps
    human = run_cli("prepare", source, out)
    assert human.exit_code == 0 and "already complete" in human.stdout


def test_lost_shard_is_rewritten_alone(tmp_path, source):
    out = tmp_path / "out"
    prepare_checkpoint(source, out)
    before = units_of(out)
    (out / "layer-00002-p0.safetensors").unlink()
    with pytest.raises(UnreadableInputError, match="missing"):
        load_prepared(out)
    report = prepare_checkpoint(source, out)
    assert (report.units_written, report.units_skipped) == (1, 4)
    assert units_of(out) == before and STATE not in listing(out)


def test_another_source_is_refused_unless_overwrite(tmp_path, source, other_source):
    out = tmp_path / "out"
    prepare_checkpoint(source, out)
    manifest = (out / "manifest.json").read_bytes()
    result = run_cli("prepare", other_source, out)
    assert result.exit_code == 2 and "another source checkpoint" in result.stderr and "--overwrite" in result.stderr
    assert (out / "manifest.json").read_bytes() == manifest and STATE not in listing(out)
    assert run_cli("prepare", other_source, out, "--overwrite", "-q").exit_code == 0
    with load_prepared(out) as p:
        assert p.fingerprint != json.loads(manifest)["source"]["fingerprint"]
        assert p.manifest["source"]["path"] == str(other_source.resolve())


def test_other_options_are_refused_unless_overwrite(tmp_path, source):
    out = tmp_path / "out"
    prepare_checkpoint(source, out, layers="0")
    with pytest.raises(UsageError, match=r"other options \(layers 0, max shard 2000000000 bytes\)"):
        prepare_checkpoint(source, out)
    with pytest.raises(UsageError, match="other options"):
        prepare_checkpoint(source, out, layers="0", max_shard_bytes="1MB")
    report = prepare_checkpoint(source, out, overwrite=True)
    assert report.layers == (0, 1, 2, 3) and report.includes_globals
    assert listing(out) == sorted(f["name"] for u in units_of(out) for f in u["files"]) + ["manifest.json"]


def test_unfinished_run_of_another_source_is_refused(tmp_path, source, other_source):
    out = tmp_path / "out"
    kill_at(source, out, "layer-00001", 5)
    with pytest.raises(UsageError, match="unfinished exl3tool prepare run from another source"):
        prepare_checkpoint(other_source, out)
    assert (out / STATE / "unit-layer-00000.json").exists()  # the refusal kept the other run's state
    prepare_checkpoint(other_source, out, overwrite=True)
    assert listing(out) == sorted(f["name"] for u in units_of(out) for f in u["files"]) + ["manifest.json"]


def test_foreign_files_are_never_touched(tmp_path, source):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    for extra in ((), ("--overwrite",)):
        result = run_cli("prepare", source, out, *extra)
        assert result.exit_code == 2 and "did not write (e.g. 'notes.txt')" in result.stderr
    assert listing(out) == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"


def test_shards_of_unknown_origin(tmp_path, source):
    out = tmp_path / "out"
    prepare_checkpoint(source, out)
    (out / "manifest.json").unlink()
    with pytest.raises(UsageError, match="without a manifest or run state"):
        prepare_checkpoint(source, out)
    assert prepare_checkpoint(source, out, overwrite=True).units_written == 5


@pytest.mark.parametrize("damage", ["not json", "edited"])
def test_unreadable_or_edited_manifest_in_out(tmp_path, source, damage):
    out = tmp_path / "out"
    prepare_checkpoint(source, out)
    if damage == "edited":  # a file size changed by hand: the recorded sizes and hashes cannot be trusted
        manifest = json.loads((out / "manifest.json").read_text())
        manifest["units"][0]["files"][0]["size"] += 1
        (out / "manifest.json").write_text(json.dumps(manifest))
    else:
        (out / "manifest.json").write_text("{not json")
    with pytest.raises(UsageError, match="cannot be read; use --overwrite"):
        prepare_checkpoint(source, out)
    prepare_checkpoint(source, out, overwrite=True)
    with load_prepared(out) as p:
        assert len(p.layers) == 4


def test_out_must_not_be_the_source_or_a_file(tmp_path, source):
    result = run_cli("prepare", model_dir("llama_mcg"), model_dir("llama_mcg"))
    assert result.exit_code == 2 and "own folder" in result.stderr
    assert STATE not in listing(model_dir("llama_mcg"))
    (tmp_path / "file").write_text("x")
    result = run_cli("prepare", model_dir("llama_mcg"), tmp_path / "file")
    assert result.exit_code == 2 and "not a folder" in result.stderr
    result = run_cli("prepare", model_dir("llama_mcg"), tmp_path / "file" / "below")
    assert result.exit_code == 2 and "cannot write output" in result.stderr


def test_concurrent_run_is_refused(tmp_path, source):
    out = tmp_path / "out"
    (out / STATE).mkdir(parents=True)
    fd = os.open(out / STATE / "lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(UsageError, match="another exl3tool prepare is writing"):
            prepare_checkpoint(source, out)
    finally:
        os.close(fd)
    assert prepare_checkpoint(source, out).units_written == 5
