"""The control bits of an instruction read as ptxas's schedule, and the issue share it leaves (CPU tier)."""

from exl3tool.sass import Control


def _word(low: int, high: int) -> bytes:
    """An instruction's 16 bytes from the two 64-bit words `nvdisasm -hex` prints (low word first)."""
    return low.to_bytes(8, "little") + high.to_bytes(8, "little")


def test_exit_reads_as_a_five_cycle_stall_that_yields():
    c = Control.of(_word(0x000000000000794D, 0x000FEA0003800000))  # EXIT, the same word on sm_80 .. sm_120
    assert (c.stall, c.yields, c.write_barrier, c.read_barrier, c.wait_mask) == (5, True, None, None, 0)


def test_each_field_has_its_own_bits():
    bits = 3 | 0 << 4 | 2 << 5 | 4 << 8 | 0b100101 << 11 | 0b1010 << 17
    c = Control.of(((bits << 105) | 0x7A8F).to_bytes(16, "little"))  # operand bits below must not leak in
    assert (c.stall, c.yields, c.write_barrier, c.read_barrier, c.wait_mask) == (3, False, 2, 4, 0b100101)
    none = Control.of(((15 | 1 << 4 | 7 << 5 | 7 << 8) << 105).to_bytes(16, "little"))
    assert (none.stall, none.yields, none.write_barrier, none.read_barrier, none.wait_mask) == (15, True, None, None, 0)


def _kernel(per_weight, stalls, registers, smem_bytes):
    """What `_row` reads of an analysed kernel (exl3tool.sass.KernelSass)."""
    from types import SimpleNamespace

    return SimpleNamespace(name="k", registers=registers, frame_bytes=0, spill_instructions=0, static_smem_bytes=0,
                           smem_per_cta_bytes=smem_bytes, main_loop=SimpleNamespace(instructions=()),
                           per_weight=per_weight, per_weight_by_pipe={}, stall_cycles_per_weight=stalls)


def test_issue_cap_is_the_resident_warps_a_scheduler_times_the_loops_issue_share():
    from types import SimpleNamespace

    from exl3tool.bench.sassreport import _row

    eight_warps = SimpleNamespace(warps=8)
    # one CTA an SM (61 KiB of SM120's 100): 2 warps a scheduler, each issuing 4 of every 16 cycles
    one = _row("k", _kernel(4.0, 16.0, 174, 61 * 1024), "sm_120a", eight_warps)
    assert one.ctas_per_sm == 1 and one.issue_cap == 0.5 and one.stall_cycles_per_weight == 16.0
    # four CTAs: 8 warps a scheduler would fill twice the slots there are
    four = _row("k", _kernel(4.0, 16.0, 48, 20 * 1024), "sm_120a", eight_warps)
    assert four.ctas_per_sm == 4 and four.issue_cap == 1.0
    assert _row("k", _kernel(None, None, 32, None), "sm_120a").issue_cap is None  # not a decode GEMM
