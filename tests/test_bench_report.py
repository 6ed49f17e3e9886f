"""`exl3tool bench`'s library on the CPU: request parsing, the derived-figure arithmetic, the JSON schema, the human
table and the plot from a hand-made report, and the driver's check-before-timing rules with fake timers."""

import io
import json
import math

import pytest
import torch
from rich.console import Console

from exl3tool.bench import report as R
from exl3tool.bench import request as Q
from exl3tool.bench.report import BenchReport, Case, Check, Environment, Result, Settings, Timing, timed_result
from exl3tool.cli.console import ToolConsole
from exl3tool.cli.render.bench import render_human
from exl3tool.errors import UsageError
from helpers import fake_timers

COPY_TBS = 4.0


def hand_made_report() -> BenchReport:
    env = Environment("NVIDIA H200", "sm_90a", "cuda:0", 132, 60 * 2**20, COPY_TBS, "2.9.0", "12.8", "abc123", "now")
    report = BenchReport(env, Settings(("graph", "eager"), 30, 3, "float16", 0, ("exllamav3",), "exl3tool bench"))
    nbytes = R.exl3_weight_bytes(4096, 14336, 4)
    for tokens, ours, peer in ((1, 20.0, 40.0), (16, 25.0, 44.0)):
        flops = R.linear_flops(tokens, 4096, 14336)
        case = Case("linear", "4096x14336", 4096, 14336, 4.0, "mcg", tokens, nbytes, R.floor_us(nbytes, COPY_TBS),
                    flops)
        ok = Check(1e-3, 0.99999, 0.01, True)
        case.results = [
            timed_result("exl3tool", "graph", Timing(ours, ours - 1, ours + 2, 3.0, 30), weight_bytes=nbytes,
                         flops=flops, copy_tbs=COPY_TBS, check=ok, compile_s=2.5, copies=6),
            timed_result("exl3tool", "eager", Timing(ours * 1.1, ours, ours * 2, 9.0, 30), weight_bytes=nbytes,
                         flops=flops, copy_tbs=COPY_TBS, check=ok, compile_s=2.5, copies=6),
            timed_result("exllamav3", "graph", Timing(peer, peer, peer, 3.0, 30), weight_bytes=nbytes, flops=flops,
                         copy_tbs=COPY_TBS, check=ok, compile_s=0.1, copies=6),
            Result("exllamav3", "eager", "eager-only", nbytes, note="capture failed"),
            Result("torch fp16", "graph", "wrong", 4096 * 14336 * 2, check=Check(math.inf, -1.0, math.nan, False),
                   note="output differs from the fp32 reference: not timed"),
        ]
        R.fill_ratios(case.results)
        report.cases.append(case)
    return report


def test_arithmetic():
    assert R.floor_us(4e6, 4.0) == pytest.approx(1.0)  # 4 MB at 4 TB/s
    assert R.weight_gbs(4e6, 2.0) == pytest.approx(2000.0)
    assert R.pct_of_copy(2000.0, 4.0) == pytest.approx(50.0)
    assert R.tflops(2e6, 1.0) == pytest.approx(2.0)
    # K=4: half a byte per padded weight, plus fp16 suh and svh; padding to 128
    assert R.exl3_weight_bytes(4096, 14336, 4) == 4096 * 14336 // 2 + 2 * (4096 + 14336)
    assert R.exl3_weight_bytes(100, 200, 2) == 128 * 256 // 4 + 2 * (128 + 256)
    assert R.linear_flops(16, 4096, 14336) == 2 * 16 * 4096 * 14336


def test_timed_result_and_ratios_are_same_mode_only():
    report = hand_made_report()
    case = report.cases[0]
    ours_graph, ours_eager, peer_graph = case.results[:3]
    assert ours_graph.vs == {"exllamav3": pytest.approx(2.0)}  # 40 / 20: twice as fast
    assert peer_graph.vs == {"exl3tool": pytest.approx(0.5)}
    assert ours_eager.vs == {}  # the peer has no eager timing; never compared across modes
    assert ours_graph.weight_gbs == pytest.approx(case.weight_bytes / 20e-6 / 1e9)
    assert ours_graph.pct_copy_bw == pytest.approx(100 * ours_graph.weight_gbs / (COPY_TBS * 1e3))
    assert ours_graph.tflops == pytest.approx(case.flops / 20e-6 / 1e12)
    assert case.results[4].timing is None and case.results[4].vs == {}
    assert [(c.tokens, r.implementation) for c, r in report.wrong] == [(1, "torch fp16"), (16, "torch fp16")]


def test_json_schema():
    data = json.loads(json.dumps(hand_made_report().to_json(), allow_nan=False))  # no NaN/Infinity in it
    assert data["schema"] == "exl3tool.bench/1"
    assert set(data["environment"]) == {"gpu", "arch", "device", "sm_count", "l2_bytes", "copy_tbs", "torch",
                                        "cuda", "commit", "date", "source"}
    assert data["settings"]["modes"] == ["graph", "eager"] and data["settings"]["peers"] == ["exllamav3"]
    case = data["cases"][0]
    assert {"kind", "name", "group", "shape", "in_features", "out_features", "bits", "codebook", "tokens",
            "weight_bytes", "floor_us", "flops", "experts", "results"} <= set(case)
    assert case["shape"] == "4096x14336" and case["group"] == "linear 4096x14336 K4 mcg"
    ours = case["results"][0]
    assert {"implementation", "mode", "status", "check", "compile_s", "copies", "weight_bytes", "median_us",
            "min_us", "max_us", "host_us", "repeats", "weight_gbs", "pct_copy_bw", "tflops", "vs", "note"} == set(ours)
    assert ours["median_us"] == 20.0 and ours["vs"]["exllamav3"] == pytest.approx(2.0) and ours["compile_s"] == 2.5
    wrong = case["results"][4]
    assert wrong["status"] == "wrong" and wrong["median_us"] is None
    assert wrong["check"] == {"rel_l2": None, "cosine": -1.0, "max_abs": None, "passed": False}


def test_human_table():
    out = io.StringIO()  # piped: the tables keep their natural width
    render_human(hand_made_report(), ToolConsole(file=out, highlight=False))
    text = out.getvalue()
    assert "NVIDIA H200" in text and "4.00 TB/s" in text and "abc123" in text
    assert "linear 4096x14336 K4 mcg" in text
    lines = text.splitlines()
    row = next(line for line in lines if "exl3tool" in line and "graph" in line and "20.00" in line)
    assert "2.00x" in row and "2.500" in row  # the ratio to the peer, the first call apart
    assert any("WRONG" in line and "torch fp16" in line for line in lines)
    assert any("eager-only" in line for line in lines)
    assert "capture failed" in text and "wrong or failed" in text


def test_plot_written(tmp_path):
    # matplotlib is in the dev environment: no skip
    from exl3tool.bench.plot import write_plot

    path = tmp_path / "perf.png"
    write_plot(hand_made_report(), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_parsers():
    assert Q.parse_shape("4096x14336") == (4096, 14336) and Q.parse_shape(" 8 X 16") == (8, 16)
    assert Q.parse_tokens("16,1,16,4096") == (1, 16, 4096)
    assert Q.parse_bits("2,4,6,4") == (2.0, 4.0, 6.0)
    assert Q.parse_moe("128:8:2048:768") == Q.MoESpec(128, 8, 2048, 768)
    assert Q.parse_modes("both") == ("graph", "eager") and Q.parse_modes("Eager") == ("eager",)
    for bad, parse in (("4096", Q.parse_shape), ("0x5", Q.parse_shape), ("a,b", Q.parse_tokens),
                       ("0", Q.parse_tokens), ("x", Q.parse_bits), ("8:9:16:16", Q.parse_moe),
                       ("8:2:16", Q.parse_moe), ("sometimes", Q.parse_modes)):
        with pytest.raises(UsageError):
            parse(bad)


def test_request_validation():
    Q.BenchRequest(shapes=((256, 512),), bits=(2.5,), codebook="mul1")
    for fields, message in (
        ({}, "nothing to measure"),
        ({"model": "m"}, "needs --layer"),
        ({"layer": 3, "shapes": ((8, 8),)}, "needs MODEL"),
        ({"model": "m", "layer": 0, "shapes": ((8, 8),)}, "not both"),
        ({"shapes": ((8, 8),), "bits": (5.5,)}, "not an EXL3 bitrate"),
        ({"shapes": ((8, 8),), "bits": (2.5,), "codebook": "mcg"}, "mul1 codebook only"),
        ({"shapes": ((8, 8),), "codebook": "fp4"}, "--codebook"),
        ({"shapes": ((8, 8),), "peers": ("marlin",)}, "unknown peer"),
        ({"shapes": ((8, 8),), "dtype": "float32"}, "--dtype"),
    ):
        with pytest.raises(UsageError, match=message):
            Q.BenchRequest(**fields)


def test_weight_copies_exceed_three_l2s():
    from exl3tool.bench.cases import MAX_COPIES, weight_copies

    l2 = 50 * 2**20
    n = weight_copies(29 * 2**20, l2)
    assert n * 29 * 2**20 > 3 * l2 and (n - 1) * 29 * 2**20 <= 3 * l2
    assert weight_copies(10 * l2, l2) == 2  # never the same weights twice in a row
    assert weight_copies(1, l2) == MAX_COPIES


def test_clone_copies_every_tensor():
    from exl3tool.bench.cases import clone
    from exl3tool.synthetic import random_linear

    t = random_linear(256, 128, 4, "mcg", seed=1, bias=True)
    c = clone(t)
    for name in ("trellis", "suh", "svh", "bias"):
        a, b = getattr(t, name), getattr(c, name)
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
    assert c.info == t.info


def test_measure_checks_before_timing(monkeypatch):
    from exl3tool.bench import cases as C
    from exl3tool.bench import run

    monkeypatch.setattr(run.torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(run, "first_call_s", lambda call: (call(), 0.5))
    timed = fake_timers(monkeypatch, run, graph_us=10.0, eager_us=30.0)
    ref = torch.randn(4, 8)
    calls = []

    def impl(name, out, capturable=True):
        def call(c):
            calls.append((name, c))
            return out
        return lambda: C.Impl(name, call, 3, 100, capturable=capturable, note="n" if not capturable else "")

    def broken():
        raise RuntimeError("no kernel\nsecond line")

    case = Case("linear", "8x8", 8, 8, 4.0, "mcg", 4, 100, 0.1, 512)
    setup = C.Setup(case, ref, [("good", impl("good", ref.half())), ("wrong", impl("wrong", ref + 1)),
                                ("host-synced", impl("host-synced", ref, capturable=False)),
                                ("absent", lambda: None), ("broken", broken)])
    request = Q.BenchRequest(shapes=((8, 8),), modes=("graph", "eager"), replays=5)
    ctx = run.Context(torch.device("cpu"), torch.float16, 0, 1, COPY_TBS, ())
    out = run.measure(setup, ctx, request)
    status = {(r.implementation, r.mode): r.status for r in out.results}
    assert status == {("good", "graph"): "ok", ("good", "eager"): "ok", ("wrong", "graph"): "wrong",
                      ("wrong", "eager"): "wrong", ("host-synced", "graph"): "eager-only",
                      ("host-synced", "eager"): "ok", ("broken", "graph"): "failed", ("broken", "eager"): "failed"}
    assert {name for name, _ in calls if name == "wrong"} == {"wrong"}
    assert [c for name, c in calls if name == "wrong"] == [0]  # checked once, never warmed or timed
    assert [mode for mode, _ in timed] == ["graph", "eager", "eager"]  # each mode: its implementations in turn
    by = {(r.implementation, r.mode): r for r in out.results}
    assert by[("good", "eager")].vs == {"host-synced": pytest.approx(1.0)}
    assert by[("broken", "graph")].note == "RuntimeError: no kernel"
    assert by[("good", "graph")].compile_s == 0.5 and by[("good", "graph")].check.passed
    assert not by[("wrong", "graph")].check.passed


def test_json_round_trip():
    data = hand_made_report().to_json()
    again = BenchReport.from_json(json.loads(json.dumps(data)))
    assert again.to_json() == json.loads(json.dumps(data))
    assert again.cases[0].results[0].timing == Timing(20.0, 19.0, 22.0, 3.0, 30)
    with pytest.raises(ValueError):
        BenchReport.from_json({"schema": "exl3tool.verify/1"})


def test_source_digest_names_the_code(tmp_path):
    """The report names the code that ran by its bytes, where git's metadata cannot (the GPU machine's copy)."""
    from exl3tool.version import source_digest

    a, b = tmp_path / "a", tmp_path / "b"
    for root in (a, b):
        (root / "pkg" / "__pycache__").mkdir(parents=True)
        (root / "pkg" / "mod.py").write_text("x = 1\n")
        (root / "top.py").write_text("y = 2\n")
    (b / "pkg" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"\0")  # not source
    assert source_digest([a]) == source_digest([b]) and len(source_digest([a])) == 12
    (b / "pkg" / "mod.py").write_text("x = 3\n")
    assert source_digest([a]) != source_digest([b])
    (b / "pkg" / "mod.py").write_text("x = 1\n")
    (b / "pkg" / "mod.py").rename(b / "pkg" / "other.py")  # same bytes, another module
    assert source_digest([a]) != source_digest([b])


def test_reports_name_their_source_and_older_ones_still_load():
    data = hand_made_report().to_json()
    assert data["environment"]["source"] is None
    data["environment"]["source"] = "01feb951fc55"
    out = io.StringIO()
    render_human(BenchReport.from_json(data), Console(file=out, width=200))
    assert "commit abc123, source 01feb951fc55;" in out.getvalue()
    del data["environment"]["source"]  # a report written before the field existed
    assert BenchReport.from_json(data).environment.source is None
