"""The A/B tool's parsing, overrides and report (``exl3tool.bench.ab``); the timing itself needs a GPU."""

import sys
import time

import pytest

from exl3tool import format as exl3_format
from exl3tool.bench import ab
from exl3tool.ops import kernel_cache, linear


def test_variants_parse_to_module_attribute_literals():
    v = ab.parse_variant("fused:exl3tool.ops.linear.FUSED_MAX_TOKENS=16; exl3tool.ops.targets.WAVE_FILL={'sm_90': 1.0}")
    assert v.name == "fused"
    assert v.overrides == (("exl3tool.ops.linear", "FUSED_MAX_TOKENS", 16),
                           ("exl3tool.ops.targets", "WAVE_FILL", {"sm_90": 1.0}))
    assert ab.parse_variant("base") == ab.Variant("base", ())
    for bad, why in [("fused:FUSED_MAX_TOKENS=16", "MODULE.ATTR=VALUE"), ("x:a.b=c d", "literal"),
                     ("two words", "identifier"), ("x:a.b", "MODULE.ATTR=VALUE")]:
        with pytest.raises(ValueError, match=why):
            ab.parse_variant(bad)


def test_cases_parse_with_defaults():
    assert ab.parse_case("dense:4096x14336:16") == ab.Case("dense", 16, 4096, 14336, 4.0, "mcg")
    assert ab.parse_case("dense:14336x4096:8:2:mul1") == ab.Case("dense", 8, 14336, 4096, 2.0, "mul1")
    assert ab.parse_case("moe:256") == ab.Case("moe", 256)
    for bad in ("dense:4096:16", "dense:4096x14336", "moe", "moe:x", "conv:1"):
        with pytest.raises(ValueError, match="dense:INxOUT:M"):
            ab.parse_case(bad)


def test_overrides_set_existing_attributes_only(monkeypatch):
    monkeypatch.setattr(linear, "FUSED_MAX_TOKENS", linear.FUSED_MAX_TOKENS)  # restored after the test
    before = linear.FUSED_MAX_TOKENS
    v = ab.parse_variant(f"x:exl3tool.ops.linear.FUSED_MAX_TOKENS={before + 5}")
    ab.apply(v, dry_run=True)
    assert linear.FUSED_MAX_TOKENS == before
    ab.apply(v)
    assert linear.FUSED_MAX_TOKENS == before + 5
    with pytest.raises(ValueError, match="has no attribute FUSED_MAX_TOKEN"):
        ab.apply(ab.parse_variant("x:exl3tool.ops.linear.FUSED_MAX_TOKEN=1"))
    with pytest.raises(ValueError, match="no module exl3tool.nope"):
        ab.apply(ab.parse_variant("x:exl3tool.nope.A=1"))


def test_a_variant_the_kernel_cache_cannot_tell_apart_turns_it_off(monkeypatch):
    """The cache names its entries by the kernel and host modules' upper-case constants: a variant that sets one
    keeps it; one that sets anything else (another package, a function) compiles its own kernels."""
    monkeypatch.setenv(kernel_cache.CACHE_ENV, "/somewhere")
    monkeypatch.setattr(linear, "FUSED_MAX_TOKENS", linear.FUSED_MAX_TOKENS)
    ab.apply(ab.parse_variant(f"x:exl3tool.ops.linear.FUSED_MAX_TOKENS={linear.FUSED_MAX_TOKENS + 1}"))
    assert kernel_cache.folder() is not None
    monkeypatch.setattr(exl3_format, "TILE", exl3_format.TILE)
    ab.apply(ab.parse_variant(f"x:exl3tool.format.TILE={exl3_format.TILE}"))
    assert kernel_cache.folder() is None
    assert kernel_cache.keyed_switch("exl3tool.kernels.mainloop", "CHUNK", (1, 2))
    assert not kernel_cache.keyed_switch("exl3tool.ops.moe", "split_halves", 0)
    assert not kernel_cache.keyed_switch("exl3tool.opsx", "A", 0)
    assert not kernel_cache.keyed_switch("exl3tool.ops.moe", "A", object())


def test_report_takes_the_median_of_each_variants_processes_and_compares_y():
    lines = [
        "compile noise",
        f"{ab.RESULT} base dense:4096x14336:16 23.0 aaaa gemm-unfused splits=4",
        f"{ab.RESULT} new dense:4096x14336:16 22.0 aaaa gemm splits=4",
        f"{ab.RESULT} base dense:4096x14336:16 23.4 aaaa gemm-unfused splits=4",
        f"{ab.RESULT} new dense:4096x14336:16 21.0 aaaa gemm splits=4",
        f"{ab.RESULT} base dense:4096x14336:16 22.9 aaaa gemm-unfused splits=4",
        f"{ab.RESULT} new dense:4096x14336:16 25.0 aaaa gemm splits=4",
        f"{ab.RESULT} base moe:1 24.7 bbbb launches=3",
        f"{ab.RESULT} new moe:1 24.6 cccc launches=3",
    ]
    rows = ab.summarize(lines).splitlines()
    dense = next(r for r in rows if r.startswith("dense:4096x14336:16"))
    assert dense.split()[1:] == ["23.00", "22.00", "same"]
    spread = rows[rows.index(dense) + 1]
    assert spread.split() == ["spread", "0.50", "4.00"]  # max - min over each variant's processes
    moe = next(r for r in rows if r.startswith("moe:1"))
    assert moe.split()[1:] == ["24.70", "24.60", "DIFFERS"]
    assert rows[rows.index(moe) + 1].split() == ["base:", "bbbb", "|", "new:", "cccc"]  # who gave which y
    assert any("base: gemm-unfused splits=4 | new: gemm splits=4" in r for r in rows)


def test_profiled_kernels_are_reported_per_case_and_variant():
    name = "kernel_cutlass_kernel_exl3toolkernelsmoe_gemmMoEGemm_object_at_0x7f_1a2b"
    assert ab.kernel_name(name) == "moe_gemmMoEGemm"
    torch_kernel = "void at::native::vectorized_elementwise_kernel<4>(int)"
    assert ab.kernel_name(torch_kernel) == "void_at::native::vectorized_elementwise_kernel<4>"
    lines = [f"{ab.RESULT} base moe:1 24.7 bbbb launches=3", f"{ab.RESULT} new moe:1 24.6 bbbb launches=3"]
    lines += [f"{ab.KERNEL} {v} moe:1 {us} {k}" for v, us, k in [
        ("base", 6.0, "moe_routeMoERoute"), ("base", 25.6, "moe_gemmMoEGemm"), ("new", 5.0, "moe_routeMoERoute"),
        ("base", 6.4, "moe_routeMoERoute"), ("new", 25.0, "moe_gemmMoEGemm"), ("new", 5.2, "moe_routeMoERoute")]]
    rows = ab.summarize(lines).splitlines()
    gemm = next(i for i, r in enumerate(rows) if "moe_gemmMoEGemm" in r)
    route = next(i for i, r in enumerate(rows) if "moe_routeMoERoute" in r)
    assert gemm < route  # the longest kernel first
    assert rows[gemm].split()[1:] == ["25.60", "25.00"] and rows[route].split()[1:] == ["6.20", "5.10"]


def test_the_timeline_is_the_middle_replays_calls_from_their_first_kernel():
    # 3 replays x 2 calls x 3 kernels (ts, dur, name); replay 1's calls start at 100 and 130 (then 40 and 50 later)
    def call(t0, jitter):
        return [(t0, 5.0 + jitter, "route"), (t0 + 1.0, 20.0, "kernel_exl3toolkernelsmoe_gemmMoEGemm_object_at_1"),
                (t0 + 18.0 + jitter, 6.0, "route")]
    events = call(0.0, 0.0) + call(30.0, 0.0) + call(100.0, 1.0) + call(130.0, 3.0) + call(200.0, 9.0)
    events += call(230.0, 9.0)
    spans = ab.layer_timeline(events[::-1], replays=3, calls=2)  # any event order
    # --profile's kernel times from the same trace: every replay's kernels summed, a call's share
    assert ab.kernel_times(events, replays=3, calls=2) == pytest.approx(
        {"route": (5.0 * 6 + 1.0 + 3.0 + 18.0 + 6.0 * 6) / 6, "moe_gemmMoEGemm": 20.0})
    assert spans == [("route", 0.0, 7.0), ("moe_gemmMoEGemm", 1.0, 21.0), ("route", 20.0, 26.0)]
    assert ab.layer_timeline(events[:-1], replays=3, calls=2) == []  # not whole calls: nothing
    lines = [f"{ab.RESULT} base moe:16 104.3 aaaa launches=5", f"{ab.RESULT} new moe:16 103.0 aaaa launches=5"]
    lines += [f"{ab.TIMELINE} {v} moe:16 {i} {s} {e} {n}" for v, i, s, e, n in [
        ("base", 0, 0.0, 7.6, "moe_routeMoERoute"), ("base", 1, 8.1, 78.0, "moe_gemmMoEGemm"),
        ("base", 0, 0.0, 7.8, "moe_routeMoERoute"), ("base", 1, 8.3, 78.4, "moe_gemmMoEGemm"),
        ("new", 0, 0.0, 6.0, "moe_routeMoERoute"), ("new", 1, 6.5, 77.0, "moe_gemmMoEGemm")]]
    rows = ab.summarize(lines).splitlines()
    route = next(r for r in rows if "0 moe_routeMoERoute" in r)
    gemm = next(r for r in rows if "1 moe_gemmMoEGemm" in r)
    assert route.split()[2:] == ["0.0-7.7", "0.0-6.0"] and gemm.split()[2:] == ["8.2-78.2", "6.5-77.0"]
    assert rows.index(route) < rows.index(gemm)  # in launch order
    # a variant that launches another kernel at an index gets its own row there, not the first variant's name
    lines += [f"{ab.TIMELINE} other moe:16 {i} {s} {e} {n}" for i, s, e, n in [
        (0, 0.0, 7.0, "moe_routeMoERoute"), (1, 7.5, 20.0, "moe_rotateIntermediate"),
        (2, 20.0, 90.0, "moe_gemmMoEGemm")]]
    lines.append(f"{ab.RESULT} other moe:16 110.0 bbbb launches=6")
    rows = ab.summarize(lines).splitlines()
    spans = [r.split() for r in rows if r.startswith("  ") and r.split()[0].isdigit()]
    at = {f"{index} {name}": cells for index, name, *cells in spans}
    assert at == {"0 moe_routeMoERoute": ["0.0-7.7", "0.0-6.0", "0.0-7.0"],
                  "1 moe_gemmMoEGemm": ["8.2-78.2", "6.5-77.0", "-"],
                  "1 moe_rotateIntermediate": ["-", "-", "7.5-20.0"],
                  "2 moe_gemmMoEGemm": ["-", "-", "20.0-90.0"]}
    assert [index for index, *_ in spans] == ["0", "1", "1", "2"]  # in launch order


def test_without_a_gpu_it_is_a_usage_error(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        ab.main(["--variant", "base", "dense:256x256:1"])
    assert exit_.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        ab.main(["--variant", "a", "--variant", "a", "dense:256x256:1"])
    assert exit_.value.code == 2 and "must differ" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        ab.main(["--variant", "a", "--cases-for", "b=moe:1", "moe:1"])
    assert exit_.value.code == 2 and "NAME one of the variants" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # past the GPU check: the lines file's folder
    with pytest.raises(SystemExit) as exit_:
        ab.main(["--variant", "a", "--lines-out", "/nonexistent/folder/lines.txt", "moe:1"])
    assert exit_.value.code == 2
    assert "--lines-out /nonexistent/folder/lines.txt: No such file" in capsys.readouterr().err


class FakeWorkers:
    """subprocess.run for run_workers: each call takes ``seconds`` of a fake clock and prints one result line of
    its variant (the command's ``--variant`` text) per case, or fails where ``fails`` names that variant, or hangs
    after its first case where ``hangs`` does (killed at the timeout, its first line captured as bytes)."""

    def __init__(self, seconds: float, fails: str = "", hangs: str = ""):
        self.now, self.seconds, self.fails, self.hangs, self.calls = 0.0, seconds, fails, hangs, []

    def clock(self) -> float:
        return self.now

    def run(self, cmd, capture_output, text, timeout=None):
        import subprocess

        assert capture_output and text
        self.now += self.seconds
        name = cmd[cmd.index("--variant") + 1].partition(":")[0]
        cases = cmd[cmd.index("--replays") + 2:]
        self.calls.append((name, cases))
        out = [f"{ab.RESULT} {name} {case} {10 + len(self.calls)}.0 aaaa launches=5\n" for case in cases]
        if name == self.hangs:
            assert timeout is not None
            raise subprocess.TimeoutExpired(cmd, timeout, output=out[0].encode())
        return subprocess.CompletedProcess(cmd, 3 if name == self.fails else 0, "".join(out), "boom")


def commands(cases_for: dict[str, list[str]]):
    return [(name, ["python", "-m", "exl3tool.bench.ab", "--worker", "--variant", f"{name}:x.y=1", "--replays",
                    "10", *cases]) for name, cases in cases_for.items()]


def test_workers_take_turns_and_keep_their_lines_as_they_end(tmp_path):
    fake = FakeWorkers(seconds=10)
    cases = ab.variant_cases(["new=moe:96"], [ab.Variant("base", ()), ab.Variant("new", ())], ["moe:16", "moe:96"])
    assert cases == {"base": ["moe:16", "moe:96"], "new": ["moe:96"]}
    out = tmp_path / "lines.txt"
    with open(out, "a") as lines_out:
        ran = ab.run_workers(commands(cases), 2, lines_out=lines_out, run=fake.run, clock=fake.clock)
    assert [name for name, _ in fake.calls] == ["base", "new", "base", "new"]
    assert fake.calls[1] == ("new", ["moe:96"])
    assert (ran.stopped, ran.failed) == (None, False) and len(ran.lines) == 6
    assert out.read_text().splitlines() == ran.lines
    table = ab.summarize(ran.lines).splitlines()
    assert next(r for r in table if r.startswith("moe:16")).split()[1:] == ["12.00", "-", "same"]


def test_a_budget_stops_new_workers_and_a_failure_stops_the_run():
    fake = FakeWorkers(seconds=10)
    ran = ab.run_workers(commands({"base": ["moe:1"], "new": ["moe:1"]}), 3, budget_s=25, run=fake.run,
                         clock=fake.clock)
    assert [name for name, _ in fake.calls] == ["base", "new", "base"]  # the fourth would start at 30 s
    assert not ran.failed and "budget of 25 s" in ran.stopped and "round 2 of 3" in ran.stopped
    assert len(ran.lines) == 3
    fake = FakeWorkers(seconds=1, fails="new")
    ran = ab.run_workers(commands({"base": ["moe:1"], "new": ["moe:1"]}), 3, run=fake.run, clock=fake.clock)
    assert ran.failed and ran.stopped is None and len(ran.dropped) == 1
    assert "variant new: worker failed (exit 3)" in ran.dropped[0] and "boom" in ran.dropped[0]
    assert [name for name, _ in fake.calls] == ["base", "new", "base", "base"]  # new dropped, base goes on
    assert len(ran.lines) == 4


def test_a_hung_worker_is_killed_and_its_variant_dropped_keeping_its_lines(tmp_path):
    fake = FakeWorkers(seconds=1, hangs="new")
    cases = {"base": ["moe:2", "moe:8"], "new": ["moe:2", "moe:8"]}
    with open(tmp_path / "lines.txt", "a") as lines_out:
        ran = ab.run_workers(commands(cases), 2, lines_out=lines_out, run=fake.run, clock=fake.clock,
                             worker_timeout_s=60)
    assert [name for name, _ in fake.calls] == ["base", "new", "base"]
    assert ran.failed and ran.dropped == ["variant new: worker killed after 60 s (round 1; a hung kernel?); its "
                                          "later cases did not run"]
    assert [line.split()[1:3] for line in ran.lines] == [["base", "moe:2"], ["base", "moe:8"], ["new", "moe:2"],
                                                        ["base", "moe:2"], ["base", "moe:8"]]
    assert (tmp_path / "lines.txt").read_text().splitlines() == ran.lines
    table = ab.summarize(ran.lines).splitlines()
    assert next(r for r in table if r.startswith("moe:8")).split()[1:] == ["12.00", "-", "same"]


def test_a_worker_timeout_is_a_positive_number_of_seconds(capsys):
    for bad in ("0", "-5"):
        with pytest.raises(SystemExit) as exit_:
            ab.main(["--variant", "a", "--worker-timeout-s", bad, "moe:1"])
        assert exit_.value.code == 2 and "a number of seconds above 0" in capsys.readouterr().err


def test_a_real_worker_past_its_timeout_is_killed_with_its_printed_lines_kept():
    """The kill path through subprocess.run itself: what a killed worker printed comes back as bytes."""
    line = f"{ab.RESULT} slow moe:1 12.000 aaaa launches=4"
    script = f"import time; print({line!r}, flush=True); time.sleep(60)"
    cmd = [sys.executable, "-c", script, "--variant", "slow", "--replays", "1", "moe:1"]
    began = time.monotonic()
    ran = ab.run_workers([("slow", cmd)], 3, worker_timeout_s=2)
    assert time.monotonic() - began < 30
    assert ran.lines == [line] and len(ran.dropped) == 1 and "killed after 2 s" in ran.dropped[0]


def test_cases_for_names_a_variant_and_cases_of_the_run():
    variants = [ab.Variant("base", ()), ab.Variant("new", ())]
    for bad, why in [("old=moe:1", "one of the variants"), ("new", "NAME=CASE"), ("new=", "NAME=CASE"),
                     ("new=moe:2", "moe:2 not among the CASEs")]:
        with pytest.raises(ValueError, match=why):
            ab.variant_cases([bad], variants, ["moe:1"])
