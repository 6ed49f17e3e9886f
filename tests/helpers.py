"""Test helpers: where the trimmed genuine fixtures are, a CLI runner that forbids tracebacks, PTX checks and a MoE
step's partials by launch."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from typer.testing import CliRunner

from exl3tool.cli import app

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
EXAMPLE = ROOT / "examples" / "qwen3moe_mul1"
GENUINE = ("llama_3inst", "llama_mcg", "llama_mul1", "qwen3moe_mul1")


def launched_partials(configs) -> list[tuple[str, str, int]]:
    """(role, partials dtype, K splits of the GEMM that wrote them) of each launch of a MoE step's ``configs``
    (``moe_configs.StepConfigs``) that stores or sums GEMM partials: gate/up and the Intermediate go by gate/up's
    splits, down and the top-k sum by down's."""
    splits = {"gate/up": configs.shape.splits13, "intermediate": configs.shape.splits13,
              "down": configs.shape.splits2, "top-k sum": configs.shape.splits2}
    return [(role, cfg.partials, splits[role]) for role, cfg in configs.kernels() if role in splits]


PDL_WAIT = "griddepcontrol.wait;"
GLOBAL_ACCESS = re.compile(r"\b(ld|st|atom|red)\.global")  # not cp.async's "shared.global"


def assert_waits_before_global_access(ptx: str, arch: str) -> None:
    """Programmatic dependent launch (sm_90 and newer): a kernel may start while the one before it finishes, so
    its one griddepcontrol.wait comes before any global access, cp.async included; SM80 has no PDL and no wait."""
    if arch == "sm_80":
        assert "griddepcontrol" not in ptx
        return
    wait = ptx.index(PDL_WAIT)
    first = GLOBAL_ACCESS.search(ptx)
    assert ptx.count(PDL_WAIT) == 1 and wait < (first.start() if first else len(ptx))
    assert "cp.async" not in ptx[:wait]


def assert_early_next(ptx: str, early: bool, arch: str) -> None:
    """``early_next``: one griddepcontrol.launch_dependents right after the kernel's wait, before any global access;
    none without it (the next kernel then launches as this one's CTAs exit) and none on SM80."""
    assert_waits_before_global_access(ptx, arch)
    if arch == "sm_80" or not early:
        assert "launch_dependents" not in ptx
        return
    wait, trigger = ptx.index(PDL_WAIT), ptx.index("griddepcontrol.launch_dependents;")
    assert ptx.count("griddepcontrol.launch_dependents;") == 1 and wait < trigger
    assert not GLOBAL_ACCESS.search(ptx[wait:trigger]) and "cp.async" not in ptx[:trigger]


def edit_config(path, **values) -> None:
    """Set keys of a checkpoint's config.json (None: remove the key)."""
    config = json.loads((path / "config.json").read_text())
    for key, value in values.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


def model_dir(name: str) -> Path:
    """The checkpoint folder of a genuine fixture (the Qwen3-MoE one is the example)."""
    return EXAMPLE if name == "qwen3moe_mul1" else FIXTURES / name


def outputs_dir(name: str) -> Path:
    return FIXTURES / name


@dataclass
class CliResult:
    exit_code: int
    stdout: str
    stderr: str

    def json(self) -> dict:
        return json.loads(self.stdout)


def run_cli(*args: str) -> CliResult:
    result = CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=True)
    # an exception escaping the app would be a traceback for the user
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    out = CliResult(result.exit_code, result.stdout, result.stderr)
    assert "Traceback" not in out.stdout + out.stderr
    return out


def fake_timers(monkeypatch, run, graph_us: float, eager_us: float) -> list[tuple[str, int]]:
    """``bench.run`` without a GPU: a "graph" replays its step, every launch runs once, and each takes the fixed
    per-call time of its mode. Returns the (mode, calls) of every timed launch, in the order they were timed."""
    from exl3tool.bench.report import Timing

    timed: list[tuple[str, int]] = []

    class Graph:
        def __init__(self, step):
            self.step = step

        def replay(self):
            self.step()

    def time_interleaved(launches, repeats):
        out = []
        for launch, calls in launches:
            launch()
            mode = "graph" if getattr(launch, "__self__", None).__class__ is Graph else "eager"
            timed.append((mode, calls))
            us = graph_us if mode == "graph" else eager_us
            out.append(Timing(us, us, us, 1.0, repeats))
        return out

    monkeypatch.setattr(run, "capture_graph", Graph)
    monkeypatch.setattr(run, "warm_up", lambda launch: None)
    monkeypatch.setattr(run, "time_interleaved", time_interleaved)
    return timed
