"""exl3tool.bench.trace's report, read from made-up stamps (no GPU): each point's spread over the CTAs that did work,
the last-to-arrive CTAs apart, each phase's length, the CTAs an SM, the CTAs without a block, the GEMMs' slots."""

import numpy as np
import pytest
import torch

from exl3tool.bench.trace import (
    live_ctas, load, main, most_at_once, report, save, slot_budget, slot_refills, spread, waves,
)
from exl3tool.kernels import ptx

T0 = 5_000_000  # ns: the route's first entry


def made_up() -> np.ndarray:
    stamps = np.zeros((ptx.TRACE_REGIONS, ptx.TRACE_REGION_CTAS, ptx.TRACE_POINTS), dtype=np.int64)

    def cta(region, index, sm, last, *us):
        stamps[region, index, : len(us)] = [T0 + int(u * 1000) for u in us]
        stamps[region, index, -1] = sm << 8 | ptx.TRACE_LIVE | (ptx.TRACE_LAST if last else 0)

    cta(ptx.TRACE_ROUTE, 0, 3, False, 0.0, 2.0, 3.0, -1.0, 3.1)  # top-k stamped by an earlier call: before t0
    cta(ptx.TRACE_ROUTE, 1, 4, True, 0.1, 2.2, 3.0, 4.0, 5.0)
    for i, (sm, loop_end) in enumerate([(0, 10.0), (0, 11.0), (1, 12.0), (2, 13.0)]):
        cta(ptx.TRACE_GATE_UP, i, sm, i == 3, 0.5, 5.5, loop_end, loop_end + 1.0, loop_end + 1.5, 6.0 + i)
    stamps[ptx.TRACE_GATE_UP, 4, 0] = T0 + 600  # an idle CTA (no flags): not counted
    cta(ptx.TRACE_DOWN, 0, 5, True, 14.0, 16.0, 19.0, 20.0, 22.0)
    return stamps


def test_live_ctas_are_those_with_flags():
    assert len(live_ctas(made_up(), ptx.TRACE_GATE_UP)) == 4


def sections(lines: list[str]) -> dict[str, dict[str, list[str]]]:
    """The report by kernel: its header line under "", then each row's label -> its numbers."""
    out: dict[str, dict[str, list[str]]] = {}
    for line in lines[1:]:
        if not line.startswith(" "):
            kernel = line.split(":")[0]
            out[kernel] = {"": [line]}
        else:
            label, numbers = line[:16].strip(), line[16:].split()
            out[kernel][label] = numbers
    return out


def test_report_spreads_points_and_phases():
    lines = report(made_up())
    assert lines[0].startswith("us from the route's first entry")
    s = sections(lines)
    assert list(s) == ["route", "gate/up", "down", "GEMM slots"]
    # SM 0 held gate/up CTAs 0 and 1 at once (both entered at 0.5 us)
    assert s["gate/up"][""] == ["gate/up: 4 CTAs on 3 SMs (1-2 an SM, median 1; 1-2 at once), 1 last to arrive"]
    assert s["route"][""] == ["route: 2 CTAs on 2 SMs (1-1 an SM, median 1; 1-1 at once), 1 last to arrive"]
    # gate/up's loops end at 10, 11, 12, 13 us: min p10 median p90 max; the last CTA's at 13
    assert s["gate/up"]["loop+P"] == ["10.00", "10.00", "11.50", "13.00", "13.00"]
    assert s["gate/up"]["last loop+P"] == ["13.00"] * 5
    assert s["gate/up"]["d loop"] == ["4.50", "4.50", "6.00", "7.50", "7.50"]
    assert s["gate/up"]["d tail"] == ["0.50"] * 5
    # the last CTAs' own: gate/up's arrived 1.0 after its loop and ended 0.5 after; down's 1.0 and 2.0; the route's
    # top-k 1.0 after its arrival, its end 1.0 after that
    assert s["gate/up"]["last d arrive"] == ["1.00"] * 5 and s["gate/up"]["last d tail"] == ["0.50"] * 5
    assert s["down"]["last d arrive"] == ["1.00"] * 5 and s["down"]["last d tail"] == ["2.00"] * 5
    assert s["route"]["last d tail"] == ["1.00"] * 5
    assert s["gate/up"]["prologue"] == ["6.00", "6.00", "7.50", "9.00", "9.00"]
    assert s["gate/up"]["d prologue"] == ["0.50", "0.50", "2.00", "3.50", "3.50"]
    assert s["down"]["prologue"] == ["-"] and s["down"]["d prologue"] == ["-"]  # down stamps none
    # the route's top-k: only the last CTA's stamp is from this call (the other is an earlier call's)
    assert s["route"]["top-k"] == ["4.00"] * 5
    assert s["route"]["entry"] == ["0.00", "0.00", "0.05", "0.10", "0.10"]
    assert s["down"]["d wait"] == ["2.00"] * 5
    # the gate/up CTA without flags entered at 0.6 us; down had none
    assert s["gate/up"]["unused"] == ["1", "CTAs", "without", "a", "block,", "entered", "0.60-0.60"]
    assert "unused" not in s["down"]
    assert lines[-1] == slot_budget(made_up(), T0)[0]


def test_slot_budget_adds_up_to_the_span():
    """SM 0 held two gate/up CTAs at once, SMs 1, 2 and 5 one GEMM CTA each: 5 slots from 0.5 to 22 us (21.5 us).
    gate/up: entries 4 x 5.0, loops 4.5 + 5.5 + 6.5 + 7.5, tails 4 x 1.5; down: 2, 3 and 3; the rest idle."""
    (line,) = slot_budget(made_up(), T0)
    assert line == ("GEMM slots: 5 over 0.5-22.0 us, in us of every slot: gate/up entries 4.0, loops 4.8, tails 1.2; "
                    "down entries 0.4, loops 0.6, tails 0.6; idle 9.9")
    assert 4.0 + 4.8 + 1.2 + 0.4 + 0.6 + 0.6 + 9.9 == pytest.approx(21.5)
    assert slot_budget(np.zeros_like(made_up()), T0) == []  # no GEMM CTA traced


def test_slot_refills_match_each_end_to_the_next_entry_on_its_sm():
    """SM 0: gate/up CTAs 0 and 1 end at 11.5 and 12.5 us (made_up), down CTAs enter at 13.0 and 16.0: gaps 1.5 and
    3.5, each entry taken once (the entry at 16.0 refills the second end, not the first down CTA's end at 15.0); an
    unused CTA (no SM) refills nothing; an end that no entry follows (SMs 1, 2, 5, 7) counts nothing."""
    stamps = made_up()
    for i, (sm, entry) in enumerate([(0, 13.0), (0, 16.0), (7, 1.0)], start=1):
        stamps[ptx.TRACE_DOWN, i, [ptx.TRACE_ENTRY, ptx.TRACE_END]] = [T0 + int(entry * 1e3), T0 + int(entry * 1e3)
                                                                       + 2000]
        stamps[ptx.TRACE_DOWN, i, -1] = sm << 8 | ptx.TRACE_LIVE
    stamps[ptx.TRACE_GATE_UP, 5, ptx.TRACE_ENTRY] = T0 + 12_600  # unused: no flags
    assert sorted(slot_refills(stamps, T0)) == [1.5, 3.5]
    line = [x for x in report(stamps) if x.startswith("GEMM slot refills")]
    assert line == ["GEMM slot refills: 2 (a GEMM CTA's end to the next entry on its SM), us: 1.50 1.50 2.50 3.50 3.50"]
    assert slot_refills(made_up(), T0) == [] and not any("refills" in x for x in report(made_up()))


def test_most_at_once_counts_overlapping_stays_per_sm():
    """Each SM's most CTAs at once, an end before an entry at the same time: SM 0's CTAs 0 and 1 overlap (2), and a
    third that enters as one of them ends does not make three."""
    rows = live_ctas(made_up(), ptx.TRACE_GATE_UP)
    assert most_at_once(rows).tolist() == [2, 1, 1]
    third = rows[:1].copy()
    third[0, ptx.TRACE_ENTRY], third[0, ptx.TRACE_END] = rows[0, ptx.TRACE_END], rows[0, ptx.TRACE_END] + 1000
    assert most_at_once(np.concatenate([rows, third])).tolist() == [2, 1, 1]


def test_report_says_when_nothing_was_traced():
    stamps = np.zeros((ptx.TRACE_REGIONS, ptx.TRACE_REGION_CTAS, ptx.TRACE_POINTS), dtype=np.int64)
    assert report(stamps) == ["no traced route CTAs (were the kernels compiled inside tracing()?)"]
    assert spread([]) == "-"


def test_the_command_needs_a_gpu(capsys):
    """Without a CUDA GPU ``python -m exl3tool.bench.trace`` stops with a one-line usage error (exit 2)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(SystemExit) as stop:
        main(["1"])
    assert stop.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err


def test_a_saved_trace_reads_back_and_reports_again_without_a_gpu(tmp_path, capsys):
    stamps = made_up()
    path = save(str(tmp_path / "out"), 16, 106.5, stamps, "NVIDIA H200")
    assert path == str(tmp_path / "out" / "trace-m16.npz")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["trace-m16.npz"]  # no part file left
    tokens, us, back, device = load(path)
    assert (tokens, us, device) == (16, 106.5, "NVIDIA H200")
    assert back.dtype == np.int64 and np.array_equal(back, stamps)
    assert main(["--load", path]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"NVIDIA H200; {path}"
    assert out[1] == "M=16: 106.50 us a call (graph replay, traced kernels)"
    assert out[2:] == ["  " + line for line in report(stamps) + waves(stamps)]


@pytest.mark.parametrize("argv, message", [
    (["--load", "{bad}"], "{bad}: not a saved trace"),
    (["--load", "{wrong}"], "{wrong}: stamps must be int64 [regions, CTAs, points], found float64 [2, 3]"),
    (["16", "--load", "{bad}"], "--load takes saved files only"),
    ([], "give at least one token count M"),
])
def test_bad_loads_stop_with_a_one_line_usage_error(tmp_path, capsys, argv, message):
    bad, wrong = tmp_path / "bad.npz", tmp_path / "wrong.npz"
    bad.write_bytes(b"not a zip")
    np.savez(wrong, stamps=np.zeros((2, 3)), us=1.0, tokens=1, device="x")
    names = {"bad": str(bad), "wrong": str(wrong)}
    with pytest.raises(SystemExit) as stop:
        main([a.format(**names) for a in argv])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and message.format(**names) in err and "Traceback" not in err


def test_waves_bin_each_gemms_loops_by_when_they_started():
    """gate/up's four CTAs waited until 5.5 us and looped 4.5, 5.5, 6.5 and 7.5 us (ends 11.5-14.5); down's one
    waited until 16 and looped 3 (end 22): one 5-us bin each, with the count, median and longest loop, latest end."""
    assert waves(made_up()) == [
        "gate/up loops by start (us): start, CTAs, median loop, longest loop, latest end",
        "       5-10         4     6.00     7.50    14.50",
        "down loops by start (us): start, CTAs, median loop, longest loop, latest end",
        "      15-20         1     3.00     3.00    22.00",
    ]
    late = made_up()
    for point in (ptx.TRACE_WAITED, ptx.TRACE_LOOP, ptx.TRACE_ARRIVED, ptx.TRACE_END):
        late[ptx.TRACE_GATE_UP, 3, point] += 10_000  # the last CTA 10 us later from its wait on: a bin of its own
    lines = waves(late)
    assert lines[1] == "       5-10         3     5.50     6.50    13.50"
    assert lines[2] == "      15-20         1     7.50     7.50    24.50"
    assert waves(np.zeros_like(made_up())) == []  # nothing traced
