"""Inline PTX for the instructions the trellis kernels need and the CuTe DSL does not spell directly.

Every wrapper is a pure value (``has_side_effects=False``) unless it touches memory, so LLVM and ptxas stay
free to schedule, hoist and CSE them. Immediates are baked into the instruction text: a constant in a register
costs a register per use site in the inner loop.
"""

import contextlib
import contextvars
import re

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


# Programmatic dependent launch (sm_90 and newer): each kernel is launched so that it may start while the kernel
# before it in the stream finishes, and waits for that kernel's writes (``wait_for_prior_kernels``) before it
# reads or writes anything another kernel touches. Set while a kernel is traced for such an arch.
_PDL = contextvars.ContextVar("exl3tool_pdl", default=False)
# A kernel may let the next one in the stream launch right after its own wait (``early_next`` in its config:
# ``griddepcontrol.launch_dependents``) instead of as its CTAs exit; that one's CTAs then take the SM room this one
# leaves and wait in turn. Only the timing changes: every kernel still waits before touching what others write.


# The archs whose split-halves decode (M <= 8) hashes paired windows (``trellis.Links``): the same instruction count
# as cutting every window, with a quarter of its ALU-pipe instructions moved to IMADs (sm_90a K=4 loop: ALU 2.41 ->
# 1.91 a weight), which pays where the ALU pipe binds. H200, graph, L2-cold, y bit-identical, us (cuts -> paired):
# 4096x14336 K=4 mcg M=1 20.80 -> 20.05, M=8 22.55 -> 21.26; 3inst M=1 20.98 -> 19.78; 14336x4096 M=8 24.75 ->
# 23.42; K=8 M=1 21.84 -> 21.80; MoE layer M=1 27.04 -> 26.18, M=2 39.66 -> 36.86, M=8 93.65 -> 86.56, M=16 129.2 ->
# 122.0. Not in the other loops (mul1 K=4 M=1 19.94 -> 21.48, K=8 M=16 24.9 -> 25.7, M=64 +2%), nor on sm_120a:
# there ptxas pads the longer chains with uniform no-ops (4.38 -> 4.48 SASS a weight) where memory is expected to
# bind.
PAIRED_HASH_ARCHS = ("sm_90",)
_ARCH = contextvars.ContextVar("exl3tool_arch", default=None)


@contextlib.contextmanager
def compiling_for(arch: str):
    """Kernels traced inside this block are compiled for ``arch`` (``sm_90a``, ...): PDL where it has it."""
    tokens = (_PDL.set(int(re.sub(r"\D", "", arch)) >= 90), _ARCH.set(arch))
    try:
        yield
    finally:
        _PDL.reset(tokens[0])
        _ARCH.reset(tokens[1])


def paired_hashes() -> bool:
    """Does the decode of the arch being compiled for hash paired windows (``PAIRED_HASH_ARCHS``)?"""
    arch = _ARCH.get()
    return arch is not None and arch.rstrip("af") in PAIRED_HASH_ARCHS


def pdl_launch() -> dict:
    """Extra ``launch`` arguments: programmatic dependent launch where the arch being compiled for has it."""
    return {"use_pdl": True} if _PDL.get() else {}


def occupancy_bounds(min_ctas_per_sm: int) -> dict:
    """Extra ``launch`` arguments: launch bounds asking ptxas for ``min_ctas_per_sm`` CTAs an SM (registers at most
    64K / (that x threads)), with the shared-memory carveout at its most (100%, so less L1): without a carveout the
    DSL asks a GPU for the SM's shared memory while it compiles, and the compile-only tests have none. 0: none."""
    return dict(min_blocks_per_mp=min_ctas_per_sm, preferred_smem_carveout=100) if min_ctas_per_sm else {}


def wait_for_prior_kernels(early_next: bool = False) -> None:
    """``griddepcontrol.wait`` under PDL: the kernel before this one in the stream has finished and its writes
    are visible; then, with ``early_next``, ``griddepcontrol.launch_dependents``. Every kernel calls it first,
    before any global access: another kernel may have written anything it reads, weights included. One exception:
    the MoE GEMMs behind a kernel that waited first (``MoEGemmConfig.weights_before_wait``). Traced
    inline; nothing without PDL."""
    if _PDL.get():
        cute.arch.griddepcontrol_wait()
        if early_next:
            cute.arch.griddepcontrol_launch_dependents()


def launch_dependents() -> None:
    """``griddepcontrol.launch_dependents`` under PDL: this CTA lets the next kernel in the stream launch (it
    launches once every CTA has done so or exited). Traced inline; nothing without PDL."""
    if _PDL.get():
        cute.arch.griddepcontrol_launch_dependents()


def _u32(value: int) -> str:
    return f"{value & 0xFFFFFFFF:#010x}"


def _asm_i32(operands, text, constraints, *, side_effects=False, loc=None, ip=None) -> Int32:
    values = [Int32(v).ir_value(loc=loc, ip=ip) for v in operands]
    return Int32(
        llvm.inline_asm(T.i32(), values, text, constraints, has_side_effects=side_effects, loc=loc, ip=ip)
    )


def _asm_4(kind, values, text, constraints, *, side_effects, count=4, loc=None, ip=None):
    """An instruction with ``count`` (default four) results of ``kind`` (Int32 or Float32), returned as a tuple."""
    ir_type = T.i32() if kind is Int32 else T.f32()
    name = "i32" if kind is Int32 else "f32"
    struct = ir.Type.parse(f"!llvm.struct<({', '.join([name] * count)})>")
    res = llvm.inline_asm(struct, values, text, constraints, has_side_effects=side_effects, loc=loc, ip=ip)
    return tuple(kind(llvm.extractvalue(ir_type, res, [i], loc=loc, ip=ip)) for i in range(count))


def _asm_void(values, text, constraints, *, loc=None, ip=None) -> None:
    """A memory instruction with no result (always a side effect: it must stay where it is)."""
    llvm.inline_asm(None, values, text, constraints, has_side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def shf_l(lo, hi, shift, *, loc=None, ip=None) -> Int32:
    """Upper 32 bits of ``(hi:lo) << min(shift, 32)``: a funnel shift that reads a 32-bit window of a
    big-endian bit stream starting ``shift`` bits into ``hi``."""
    return _asm_i32([lo, hi, shift], "shf.l.clamp.b32 $0, $1, $2, $3;", "=r,r,r,r", loc=loc, ip=ip)


@dsl_user_op
def shf_l_imm(lo, hi, shift: int, *, loc=None, ip=None) -> Int32:
    return _asm_i32([lo, hi], f"shf.l.clamp.b32 $0, $1, $2, {shift};", "=r,r,r", loc=loc, ip=ip)


@dsl_user_op
def shl(x, shift, *, loc=None, ip=None) -> Int32:
    return _asm_i32([x, shift], "shl.b32 $0, $1, $2;", "=r,r,r", loc=loc, ip=ip)


@dsl_user_op
def cut16(x, byte: int, *, loc=None, ip=None) -> Int32:
    """Bits ``[32 - 8*byte - 16, 32 - 8*byte)`` of x (byte 0, 1 or 2 counted from the top), zero-extended: one
    SHR for the top half, else one PRMT taking two bytes of x and two zero bytes."""
    if byte == 0:
        return _asm_i32([x], "shr.b32 $0, $1, 16;", "=r,r", loc=loc, ip=ip)
    selector = (0x4421, 0x4410)[byte - 1]
    return _asm_i32([x], f"prmt.b32 $0, $1, 0, {selector:#06x};", "=r,r", loc=loc, ip=ip)


@dsl_user_op
def shl_imm(x, shift: int, *, loc=None, ip=None) -> Int32:
    """``x << shift`` written as a multiply: ptxas issues it as IMAD.SHL on the FMA pipe, which the trellis
    decode leaves idle while its logic ops saturate the ALU pipe."""
    return _asm_i32([x], f"mul.lo.u32 $0, $1, {_u32(1 << shift)};", "=r,r", loc=loc, ip=ip)


@dsl_user_op
def half_sums(a, b, *, loc=None, ip=None) -> Int32:
    """``(lo(a) + hi(a), lo(b) + hi(b))`` as fp16x2: two half adds reading register halves (FMA pipe) and one
    pack, instead of two byte permutes (ALU pipe) and one paired add."""
    text = (
        "{.reg .b16 al, ah, bl, bh, sa, sb; mov.b32 {al, ah}, $1; mov.b32 {bl, bh}, $2; "
        "add.rn.f16 sa, al, ah; add.rn.f16 sb, bl, bh; mov.b32 $0, {sa, sb};}"
    )
    return _asm_i32([a, b], text, "=r,r,r", loc=loc, ip=ip)



@dsl_user_op
def half2_to_f32(x, *, loc=None, ip=None):
    """The two fp16 halves of x (low half first), widened to Float32."""
    text = "{.reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi;}"
    values = [Int32(x).ir_value(loc=loc, ip=ip)]
    return _asm_4(Float32, values, text, "=f,=f,r", side_effects=False, count=2, loc=loc, ip=ip)


@dsl_user_op
def dup_half(x, half: int, *, loc=None, ip=None) -> Int32:
    """``(h, h)`` for h the low (0) or high (1) fp16 half of x, as an exact fp16 add of -0.0 reading one
    half twice: an HADD2 with an operand swizzle (FMA pipe) instead of a PRMT (ALU pipe)."""
    text = (
        "{.reg .b16 lo, hi; .reg .b32 t, z; mov.b32 {lo, hi}, $1; mov.b32 z, 0x80008000; "
        f"mov.b32 t, {{{('lo', 'hi')[half]}, {('lo', 'hi')[half]}}}; add.rn.f16x2 $0, t, z;}}"
    )
    return _asm_i32([x], text, "=r,r", loc=loc, ip=ip)


@dsl_user_op
def mul_lo_imm(x, factor: int, *, loc=None, ip=None) -> Int32:
    return _asm_i32([x], f"mul.lo.u32 $0, $1, {_u32(factor)};", "=r,r", loc=loc, ip=ip)


@dsl_user_op
def mad_lo_imm(x, factor: int, addend: int, *, loc=None, ip=None) -> Int32:
    return _asm_i32([x], f"mad.lo.u32 $0, $1, {_u32(factor)}, {_u32(addend)};", "=r,r", loc=loc, ip=ip)


@dsl_user_op
def mad_lo_imm_add(x, factor: int, addend, *, loc=None, ip=None) -> Int32:
    """``x * factor + addend`` (mod 2^32) with ``addend`` a register: one IMAD."""
    return _asm_i32([x, addend], f"mad.lo.u32 $0, $1, {_u32(factor)}, $2;", "=r,r,r", loc=loc, ip=ip)


@dsl_user_op
def pinned(value: int, *, loc=None, ip=None) -> Int32:
    """A constant in a register (made once, outside the loop): LOP3 has one immediate slot, so the second
    constant of ``and_xor`` must come from a register or ptxas splits the LOP3 in two."""
    return _asm_i32([], f"mov.b32 $0, {_u32(value)};", "=r", loc=loc, ip=ip)


@dsl_user_op
def and_xor(x, mask: int, flip, *, loc=None, ip=None) -> Int32:
    """``(x & mask) ^ flip`` in one LOP3 (``mask`` immediate, ``flip`` a register from ``pinned``)."""
    return _asm_i32([x, flip], f"lop3.b32 $0, $1, {_u32(mask)}, $2, 0x6a;", "=r,r,r", loc=loc, ip=ip)


@dsl_user_op
def prmt_imm(a, b, selector: int, *, loc=None, ip=None) -> Int32:
    return _asm_i32([a, b], f"prmt.b32 $0, $1, $2, {selector:#06x};", "=r,r,r", loc=loc, ip=ip)


@dsl_user_op
def dp4a_bytesum(x, base: int, *, loc=None, ip=None) -> Int32:
    """``base + sum of the four unsigned bytes of x`` in one DP4A."""
    text = (
        "{.reg .b32 ones, acc; mov.b32 ones, 0x01010101; mov.b32 acc, "
        f"{_u32(base)}; dp4a.u32.u32 $0, $1, ones, acc;}}"
    )
    return _asm_i32([x], text, "=r,r", loc=loc, ip=ip)



@dsl_user_op
def hfma2_imm(a, mul: int, add: int, *, loc=None, ip=None) -> Int32:
    text = (
        f"{{.reg .b32 m, c; mov.b32 m, {_u32(mul)}; mov.b32 c, {_u32(add)}; "
        "fma.rn.f16x2 $0, $1, m, c;}"
    )
    return _asm_i32([a], text, "=r,r", loc=loc, ip=ip)


@dsl_user_op
def mma_m16n8k16_f32(a, b, c, dtype: str, *, loc=None, ip=None):
    """``D = A @ B + C`` for one warp with fp16 or bf16 A (4 regs) and B (2 regs), fp32 C/D (4 regs)."""
    kind = {"float16": "f16", "bfloat16": "bf16"}[dtype]
    values = [Int32(v).ir_value(loc=loc, ip=ip) for v in (*a, *b)]
    values += [Float32(v).ir_value(loc=loc, ip=ip) for v in c]
    text = (f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 {{$0,$1,$2,$3}}, {{$4,$5,$6,$7}}, {{$8,$9}}, "
            "{$10,$11,$12,$13};")
    return _asm_4(Float32, values, text, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", side_effects=False, loc=loc, ip=ip)


@dsl_user_op
def split_product(x, s, *, loc=None, ip=None):
    """fp16x2 ``x * s`` as two fp16x2 words ``(hi, lo)``: hi = x * s rounded, lo = x * s - hi (one HMUL2, one
    HFMA2; exact while lo is a normal fp16)."""
    text = "{.reg .b32 h, n; mul.rn.f16x2 h, $2, $3; neg.f16x2 n, h; fma.rn.f16x2 $1, $2, $3, n; mov.b32 $0, h;}"
    values = [Int32(v).ir_value(loc=loc, ip=ip) for v in (x, s)]
    return _asm_4(Int32, values, text, "=r,=r,r,r", side_effects=False, count=2, loc=loc, ip=ip)


@dsl_user_op
def mul_f16x2(x, s, *, loc=None, ip=None) -> Int32:
    return _asm_i32([x, s], "mul.rn.f16x2 $0, $1, $2;", "=r,r,r", loc=loc, ip=ip)


@dsl_user_op
def cp_async(smem_addr, gmem_addr, src_bytes, size: int = 16, *, loc=None, ip=None) -> None:
    """Asynchronous global->shared copy of ``size`` bytes (16: ``.cg``, L2 only; 8 or 4: ``.ca``, which ``.cg``
    does not take); ``src_bytes`` < size zero-fills the rest (0 = all zeros)."""
    cache = "cg" if size == 16 else "ca"
    values = [Int32(smem_addr).ir_value(loc=loc, ip=ip), Int64(gmem_addr).ir_value(loc=loc, ip=ip),
              Int32(src_bytes).ir_value(loc=loc, ip=ip)]
    _asm_void(values, f"cp.async.{cache}.shared.global [$0], [$1], {size}, $2;", "r,l,r", loc=loc, ip=ip)


@dsl_user_op
def cp_async_row(smem_addr, s_offset: int, gmem_base, row_bytes, index: int, row: int, rows_left,
                 *, loc=None, ip=None) -> None:
    """16-byte ``.cg`` copy from ``gmem_base + index * row_bytes`` to ``smem_addr + s_offset``; zero-filled, its
    source never read, when ``rows_left <= row``."""
    values = [Int32(smem_addr).ir_value(loc=loc, ip=ip), Int64(gmem_base).ir_value(loc=loc, ip=ip),
              Int32(row_bytes).ir_value(loc=loc, ip=ip), Int32(rows_left).ir_value(loc=loc, ip=ip)]
    text = (f"{{.reg .pred p; .reg .u64 a; setp.le.s32 p, $3, {row}; mad.wide.u32 a, $2, {index}, $1; "
            f"cp.async.cg.shared.global [$0+{s_offset}], [a], 16, p;}}")
    _asm_void(values, text, "r,l,r,r", loc=loc, ip=ip)


@dsl_user_op
def st_shared_b32(smem_addr, value, *, loc=None, ip=None) -> None:
    values = [Int32(smem_addr).ir_value(loc=loc, ip=ip), Int32(value).ir_value(loc=loc, ip=ip)]
    _asm_void(values, "st.shared.b32 [$0], $1;", "r,r", loc=loc, ip=ip)


@dsl_user_op
def st_shared_f32(smem_addr, value, *, loc=None, ip=None) -> None:
    values = [Int32(smem_addr).ir_value(loc=loc, ip=ip), Float32(value).ir_value(loc=loc, ip=ip)]
    _asm_void(values, "st.shared.f32 [$0], $1;", "r,f", loc=loc, ip=ip)


@dsl_user_op
def st_shared_v4(smem_addr, words, *, loc=None, ip=None) -> None:
    """Store four 32-bit words to a 16-byte aligned shared address."""
    values = [Int32(smem_addr).ir_value(loc=loc, ip=ip)] + [Int32(w).ir_value(loc=loc, ip=ip) for w in words]
    _asm_void(values, "st.shared.v4.b32 [$0], {$1,$2,$3,$4};", "r,r,r,r,r", loc=loc, ip=ip)


@dsl_user_op
def ld_shared_v4(smem_addr, kind=Int32, *, loc=None, ip=None):
    """Four 32-bit values from a 16-byte aligned shared address: Int32 words or Float32."""
    values = [Int32(smem_addr).ir_value(loc=loc, ip=ip)]
    t, c = ("b32", "r") if kind is Int32 else ("f32", "f")
    return _asm_4(kind, values, f"ld.shared.v4.{t} {{$0,$1,$2,$3}}, [$4];", f"={c},={c},={c},={c},r",
                  side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def bulk_stage_copy(tid, bar_addr, pieces, size: int, *, loc=None, ip=None) -> None:
    """In the thread whose ``tid`` is 0: announce ``len(pieces) * size`` bytes on the mbarrier at shared address
    ``bar_addr`` and arrive on it once, then copy each ``(shared address, global address)`` piece of ``size`` bytes
    (16-byte aligned, a multiple of 16) with one bulk copy (the TMA unit, no tensor map) that completes those bytes
    on the mbarrier. Predicated inside one asm block: no branch."""
    values = [Int32(tid).ir_value(loc=loc, ip=ip), Int32(bar_addr).ir_value(loc=loc, ip=ip)]
    text = ["{.reg .pred p; setp.eq.b32 p, $0, 0;",
            f"@p mbarrier.arrive.expect_tx.shared::cta.b64 _, [$1], {len(pieces) * size};"]
    for i, (s_addr, g_addr) in enumerate(pieces):
        values += [Int32(s_addr).ir_value(loc=loc, ip=ip), Int64(g_addr).ir_value(loc=loc, ip=ip)]
        text.append(f"@p cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [${2 + 2 * i}], "
                    f"[${3 + 2 * i}], {size}, [$1];")
    text.append("}")
    _asm_void(values, " ".join(text), ",".join(["r", "r"] + ["r", "l"] * len(pieces)), loc=loc, ip=ip)


@dsl_user_op
def st_global_v4(gmem_addr, values, kind=Int32, *, loc=None, ip=None) -> None:
    """Store four 32-bit values to a 16-byte aligned global address: Int32 words or Float32."""
    t, c = ("b32", "r") if kind is Int32 else ("f32", "f")
    args = [Int64(gmem_addr).ir_value(loc=loc, ip=ip)] + [kind(v).ir_value(loc=loc, ip=ip) for v in values]
    _asm_void(args, f"st.global.v4.{t} [$0], {{$1,$2,$3,$4}};", f"l,{c},{c},{c},{c}", loc=loc, ip=ip)


@dsl_user_op
def ld_global_cg_v4_f16_as_f32(gmem_addr, *, loc=None, ip=None):
    """Four fp16 from an 8-byte aligned global address (L2 only, like ``ld_global_cg_v4_f32``), widened to fp32."""
    text = (
        "{.reg .b16 h0, h1, h2, h3; ld.global.cg.v4.b16 {h0, h1, h2, h3}, [$4]; "
        "cvt.f32.f16 $0, h0; cvt.f32.f16 $1, h1; cvt.f32.f16 $2, h2; cvt.f32.f16 $3, h3;}"
    )
    values = [Int64(gmem_addr).ir_value(loc=loc, ip=ip)]
    return _asm_4(Float32, values, text, "=f,=f,=f,=f,l", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def ld_global_cg_f32_or_neg_zero(gmem_addr, load, *, loc=None, ip=None) -> Float32:
    """One fp32 from global memory, cached in L2 only (as ``ld_global_cg_v4_f32``), where ``load`` is nonzero;
    else -0.0 (no memory access), which adds to any value without changing it."""
    values = [Int64(gmem_addr).ir_value(loc=loc, ip=ip), Int32(load).ir_value(loc=loc, ip=ip)]
    text = "{.reg .pred p; setp.ne.b32 p, $2, 0; mov.b32 $0, 0x80000000; @p ld.global.cg.f32 $0, [$1];}"
    return Float32(llvm.inline_asm(T.f32(), values, text, "=f,l,r", has_side_effects=True, loc=loc, ip=ip))


@dsl_user_op
def ld_global_cg_v4_f32_or_neg_zero(gmem_addr, load, *, loc=None, ip=None):
    """``ld_global_cg_v4_f32`` where ``load`` is nonzero; else four -0.0 (no memory access), which add to any
    value without changing it."""
    values = [Int64(gmem_addr).ir_value(loc=loc, ip=ip), Int32(load).ir_value(loc=loc, ip=ip)]
    text = ("{.reg .pred p; setp.ne.b32 p, $5, 0; mov.b32 $0, 0x80000000; mov.b32 $1, 0x80000000; "
            "mov.b32 $2, 0x80000000; mov.b32 $3, 0x80000000; @p ld.global.cg.v4.f32 {$0,$1,$2,$3}, [$4];}")
    return _asm_4(Float32, values, text, "=f,=f,=f,=f,l,r", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def ld_global_cg_v4_f32(gmem_addr, *, loc=None, ip=None):
    """Four fp32 from a 16-byte aligned global address, cached in L2 only: data other CTAs just wrote
    (after ``count_in``) must not come from a stale L1 line."""
    values = [Int64(gmem_addr).ir_value(loc=loc, ip=ip)]
    return _asm_4(Float32, values, "ld.global.cg.v4.f32 {$0,$1,$2,$3}, [$4];", "=f,=f,=f,=f,l", side_effects=True,
                  loc=loc, ip=ip)


@dsl_user_op
def atomic_add_u32(gmem_addr, value, *, loc=None, ip=None) -> Int32:
    """``old = *addr; *addr += value`` atomically, device scope; returns old."""
    return _asm_i32_addr(gmem_addr, value, "atom.global.add.u32 $0, [$1], $2;", loc=loc, ip=ip)


@dsl_user_op
def atomic_add_acq_rel_u32(gmem_addr, value, *, loc=None, ip=None) -> Int32:
    """``old = *addr; *addr += value`` atomically, device scope, releasing this thread's (and, through a CTA
    barrier before it, its CTA's) writes and acquiring those released to the counter before it."""
    return _asm_i32_addr(gmem_addr, value, "atom.acq_rel.gpu.global.add.u32 $0, [$1], $2;", loc=loc, ip=ip)


@dsl_user_op
def st_global_u32(gmem_addr, value, *, loc=None, ip=None) -> None:
    values = [Int64(gmem_addr).ir_value(loc=loc, ip=ip), Int32(value).ir_value(loc=loc, ip=ip)]
    _asm_void(values, "st.global.u32 [$0], $1;", "l,r", loc=loc, ip=ip)


def _asm_i32_addr(gmem_addr, value, text, *, loc=None, ip=None) -> Int32:
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Int64(gmem_addr).ir_value(loc=loc, ip=ip), Int32(value).ir_value(loc=loc, ip=ip)],
            text,
            "=r,l,r",
            has_side_effects=True,
            loc=loc,
            ip=ip,
        )
    )


# --- grid-level steps built from the instructions above ---------------------------------------------------------


@cute.jit
def count_in(counter: Int64, expected: Int32, flag: cute.Tensor, slot: cutlass.Constexpr, tid: Int32):
    """Release this CTA's global writes, then count it in at ``counter``: ``flag[slot]`` (shared memory) becomes 1
    in the CTA that arrives ``expected``-th and 0 in the others, and there the others' writes are visible to every
    thread. Thread 0's one ``atom.acq_rel.gpu`` between two CTA barriers (CUTLASS's semaphore pattern: the barriers
    carry the order from and to the other threads) instead of every thread's ``fence.acq_rel.gpu`` before the
    atomic and again in the last CTA: H200, graph, y bit-identical, us: dense M=1 4096x14336 20.0 -> 19.6, 4096x4096
    9.85 -> 9.52; MoE E=128 top-8 2048x768 M=1 27.8 -> 26.8, M=16 120.8 -> 119.5 (docs/perf.md, nineteenth
    session)."""
    cute.arch.sync_threads()
    if tid == 0:
        arrived = atomic_add_acq_rel_u32(counter, Int32(1))
        flag[slot] = Int32(arrived == expected - 1)
    cute.arch.sync_threads()


@dsl_user_op
def ld_acquire_u32(gmem_addr, *, loc=None, ip=None) -> Int32:
    """A device-scope acquire load: what was released to this word before the value read is visible."""
    values = [Int64(gmem_addr).ir_value(loc=loc, ip=ip)]
    return Int32(llvm.inline_asm(T.i32(), values, "ld.acquire.gpu.global.u32 $0, [$1];", "=r,l",
                                 has_side_effects=True, loc=loc, ip=ip))


@dsl_user_op
def st_release_u32(gmem_addr, value, *, loc=None, ip=None) -> None:
    """A device-scope release store: this thread's writes before it are visible to whoever acquires the value."""
    values = [Int64(gmem_addr).ir_value(loc=loc, ip=ip), Int32(value).ir_value(loc=loc, ip=ip)]
    _asm_void(values, "st.release.gpu.global.u32 [$0], $1;", "l,r", loc=loc, ip=ip)


@dsl_user_op
def nanosleep(ns: int, *, loc=None, ip=None) -> None:
    _asm_void([], f"nanosleep.u32 {ns};", "", loc=loc, ip=ip)


@cute.jit
def signal_count(counter: Int64, tid: Int32):
    """Release this CTA's global writes to ``counter`` and add one to it (``wait_count``'s writers): a CTA barrier,
    then thread 0's ``atom.acq_rel.gpu``."""
    cute.arch.sync_threads()
    if tid == 0:
        atomic_add_acq_rel_u32(counter, Int32(1))


@cute.jit
def wait_count(counter: Int64, target: Int32, readers: Int32, tid: Int32, then_count_out: cutlass.Constexpr = True):
    """Wait until ``counter`` reaches ``target`` (writers' ``count_in``-style releases), then count this CTA out as
    one of its ``readers`` (``count_out``; without ``then_count_out`` the caller does that later). Thread 0 spins
    (acquire loads, backing off) between two CTA barriers, which carry the order to the other threads, as in
    ``count_in``."""
    cute.arch.sync_threads()
    if tid == 0:
        seen = ld_acquire_u32(counter)
        while seen < target:
            nanosleep(256)
            seen = ld_acquire_u32(counter)
        if cutlass.const_expr(then_count_out):
            count_out(counter, target, readers, tid)
    cute.arch.sync_threads()


@cute.jit
def count_out(counter: Int64, target: Int32, readers: Int32, tid: Int32):
    """Thread 0 counts this CTA out of ``wait_count``'s counter once the target was seen: the last of its ``readers``
    resets it to zero for the next launch. Apart from the wait, its atomic's round trip overlaps the work issued in
    between (thread 0's warp alone waits for it)."""
    if tid == 0:
        if atomic_add_u32(counter, Int32(1)) == target + readers - 1:
            st_global_u32(counter, Int32(0))


@dsl_user_op
def pack_f32x2(lo, hi, dtype: str, *, loc=None, ip=None) -> Int32:
    """Two Float32 rounded to nearest and packed as fp16x2 or bf16x2 (``lo`` in the low half): one cvt."""
    kind = {"float16": "f16x2", "bfloat16": "bf16x2"}[dtype]
    values = [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)]
    return Int32(llvm.inline_asm(T.i32(), values, f"cvt.rn.{kind}.f32 $0, $1, $2;", "=r,f,f",
                                 has_side_effects=False, loc=loc, ip=ip))


# --- helpers of the fused MoE kernels -------------------------------------------------------------------------


@dsl_user_op
def ld_global_v2_b32(gmem_addr, *, loc=None, ip=None):
    """Two 32-bit words from an 8-byte aligned global address (data this launch does not write)."""
    values = [Int64(gmem_addr).ir_value(loc=loc, ip=ip)]
    return _asm_4(Int32, values, "ld.global.v2.b32 {$0,$1}, [$2];", "=r,=r,l", side_effects=True, count=2,
                  loc=loc, ip=ip)


@dsl_user_op
def ld_global_v4_b32(gmem_addr, *, loc=None, ip=None):
    """Four 32-bit words from a 16-byte aligned global address (data this launch does not write)."""
    values = [Int64(gmem_addr).ir_value(loc=loc, ip=ip)]
    return _asm_4(Int32, values, "ld.global.v4.b32 {$0,$1,$2,$3}, [$4];", "=r,=r,=r,=r,l", side_effects=True,
                  loc=loc, ip=ip)


@dsl_user_op
def ld_global_cg_v4_b32(gmem_addr, *, loc=None, ip=None):
    """Four 32-bit words from a 16-byte aligned global address, cached in L2 only (``ld_global_cg_v4_f32``)."""
    values = [Int64(gmem_addr).ir_value(loc=loc, ip=ip)]
    return _asm_4(Int32, values, "ld.global.cg.v4.b32 {$0,$1,$2,$3}, [$4];", "=r,=r,=r,=r,l", side_effects=True,
                  loc=loc, ip=ip)


@dsl_user_op
def st_global_v2_b32(gmem_addr, w0, w1, *, loc=None, ip=None) -> None:
    values = [Int64(gmem_addr).ir_value(loc=loc, ip=ip)] + [Int32(w).ir_value(loc=loc, ip=ip) for w in (w0, w1)]
    _asm_void(values, "st.global.v2.b32 [$0], {$1,$2};", "l,r,r", loc=loc, ip=ip)


@dsl_user_op
def words_to_f32(w0, w1, dtype: str, *, loc=None, ip=None):
    """The four fp16 or bf16 halves of two words (low half first), widened to Float32."""
    if dtype == "float16":
        text = ("{.reg .b16 a, b, c, d; mov.b32 {a, b}, $4; mov.b32 {c, d}, $5; cvt.f32.f16 $0, a; "
                "cvt.f32.f16 $1, b; cvt.f32.f16 $2, c; cvt.f32.f16 $3, d;}")
    else:  # bf16 -> fp32 is the bits moved to the top half (no cvt.f32.bf16 before sm_90)
        text = ("{.reg .b32 t; shl.b32 t, $4, 16; mov.b32 $0, t; and.b32 t, $4, 0xffff0000; mov.b32 $1, t; "
                "shl.b32 t, $5, 16; mov.b32 $2, t; and.b32 t, $5, 0xffff0000; mov.b32 $3, t;}")
    values = [Int32(w).ir_value(loc=loc, ip=ip) for w in (w0, w1)]
    return _asm_4(Float32, values, text, "=f,=f,=f,=f,r,r", side_effects=False, loc=loc, ip=ip)


@dsl_user_op
def f16x2_as_bf16x2_pair(x, *, loc=None, ip=None):
    """(hi, lo) bf16x2 with ``hi + lo`` exactly the two fp16 of x (fp16 has 11 significant bits, bf16 8, so the
    rounding remainder fits in bf16): lets bf16 activations meet an fp16 matrix in bf16 MMAs without loss."""
    text = (
        "{.reg .b16 l, h; .reg .f32 fl, fh, gl, gh; .reg .b32 t; mov.b32 {l, h}, $2; cvt.f32.f16 fl, l; "
        "cvt.f32.f16 fh, h; cvt.rn.bf16x2.f32 $0, fh, fl; shl.b32 t, $0, 16; mov.b32 gl, t; "
        "and.b32 t, $0, 0xffff0000; mov.b32 gh, t; sub.f32 fl, fl, gl; sub.f32 fh, fh, gh; "
        "cvt.rn.bf16x2.f32 $1, fh, fl;}"
    )
    values = [Int32(x).ir_value(loc=loc, ip=ip)]
    return _asm_4(Int32, values, text, "=r,=r,r", side_effects=False, count=2, loc=loc, ip=ip)


@dsl_user_op
def order_key(v, *, loc=None, ip=None) -> Int32:
    """The bits of fp32 ``v`` mapped so that unsigned integer order is float order (-inf lowest)."""
    text = "{.reg .b32 b, s; mov.b32 b, $1; shr.s32 s, b, 31; or.b32 s, s, 0x80000000; xor.b32 $0, b, s;}"
    return Int32(llvm.inline_asm(T.i32(), [Float32(v).ir_value(loc=loc, ip=ip)], text, "=r,f",
                                 has_side_effects=False, loc=loc, ip=ip))


@dsl_user_op
def ld_shared_v2_b32(smem_addr, *, loc=None, ip=None):
    """Two 32-bit words from an 8-byte aligned shared address."""
    values = [Int32(smem_addr).ir_value(loc=loc, ip=ip)]
    return _asm_4(Int32, values, "ld.shared.v2.b32 {$0,$1}, [$2];", "=r,=r,r", side_effects=True, count=2,
                  loc=loc, ip=ip)


# --- warpgroup MMA (sm_90a only): the wide-M decode GEMM (``GemmConfig.mma == "wgmma"``) -------------------------
# A warpgroup (4 warps) multiplies a 64-row A held in registers (each warp's 16 rows in the mma.m16n8k16 A-fragment
# layout: the decoded weight tile as it comes out of ``trellis.mma_a_fragment``) by a K=16 x N B read straight from
# shared memory (a descriptor), N = 8..256 tokens, accumulating fp32 asynchronously. B is K-major with the 128-byte
# swizzle: token rows of 64 fp16 (128 bytes) each, 8-row groups of 1024 bytes, 16-byte piece p of row n at
# p ^ (n % 8) (``trellis.wgmma_swizzled_piece``); its 1024-byte atoms must be 1024-byte aligned.

WGMMA_SWIZZLE_128B = 1 << 62  # the descriptor's layout type
WGMMA_GROUP_BYTES = 1024  # stride between 8-row groups (the descriptor's SBO)


def wgmma_descriptor_high() -> int:
    """The descriptor's constant fields: 128-byte swizzle, SBO 1024 bytes, LBO 16 (unused by swizzled K-major)."""
    return WGMMA_SWIZZLE_128B | ((WGMMA_GROUP_BYTES >> 4) << 32) | (1 << 16)


@dsl_user_op
def wgmma_fence(*, loc=None, ip=None) -> None:
    """Registers written since are visible to the next ``wgmma_m64k16`` (the A fragments just decoded)."""
    _asm_void([], "wgmma.fence.sync.aligned;", "", loc=loc, ip=ip)


@dsl_user_op
def wgmma_commit(*, loc=None, ip=None) -> None:
    _asm_void([], "wgmma.commit_group.sync.aligned;", "", loc=loc, ip=ip)


@dsl_user_op
def wgmma_wait(pending: int, *, loc=None, ip=None) -> None:
    """Wait until at most ``pending`` committed groups of this warpgroup's wgmma are still running."""
    _asm_void([], f"wgmma.wait_group.sync.aligned {pending};", "", loc=loc, ip=ip)


@dsl_user_op
def fence_proxy_async_shared(*, loc=None, ip=None) -> None:
    """Shared-memory writes of this thread (cp.async, st.shared) become visible to the async proxy (wgmma)."""
    _asm_void([], "fence.proxy.async.shared::cta;", "", loc=loc, ip=ip)


@dsl_user_op
def wgmma_m64k16(a, desc, acc, dtype: str, *, loc=None, ip=None):
    """``acc += A @ B`` for the warpgroup: A fp16/bf16 in registers (4 words a lane), B from the shared-memory
    descriptor ``desc`` (Int64), ``acc`` the lane's N/2 fp32 accumulators (N = 2*len(acc) tokens), returned
    updated. Asynchronous: commit, then wait before reading the result (and before writing the registers of A).
    Accumulator j of a lane holds D row ``16*warp + lane//4 + 8*(j%4 >= 2)``, column ``8*(j//4) + 2*(lane%4) + j%2``,
    as ``mma.m16n8k16`` groups. No predicate: ptxas fences every MMA of a group that holds a predicated one."""
    kind = {"float16": "f16", "bfloat16": "bf16"}[dtype]
    n = len(acc)
    outs = ",".join(f"${i}" for i in range(n))
    text = (f"{{.reg .pred p; setp.ne.b32 p, ${n + 5}, 0; "
            f"wgmma.mma_async.sync.aligned.m64n{2 * n}k16.f32.{kind}.{kind} "
            f"{{{outs}}}, {{${n},${n + 1},${n + 2},${n + 3}}}, ${n + 4}, p, 1, 1, 0;}}")
    constraints = ",".join(["=f"] * n + ["r"] * 4 + ["l", "r"] + [str(i) for i in range(n)])
    values = [Int32(v).ir_value(loc=loc, ip=ip) for v in a] + [Int64(desc).ir_value(loc=loc, ip=ip),
                                                             Int32(1).ir_value(loc=loc, ip=ip)]
    values += [Float32(v).ir_value(loc=loc, ip=ip) for v in acc]
    return _asm_4(Float32, values, text, constraints, side_effects=True, count=n, loc=loc, ip=ip)


# --- the per-CTA timing trace (exl3tool.bench.trace) -----------------------------------------------------------

# A device address, set before the kernels compile (they are other kernels then: ops.runtime keys them by it); 0: the
# kernels hold no trace code at all.
TRACE_ADDR = 0
TRACE_REGION_CTAS = 8192  # CTAs a kernel's region holds; CTAs past it store nothing
TRACE_POINTS = 8  # u64 slots a CTA: %globaltimer (ns) at points 0-5, its SM id << 8 | flags in the last
TRACE_ROUTE, TRACE_GATE_UP, TRACE_DOWN = 0, 1, 2  # regions, one a kernel (one expert group's GEMMs)
TRACE_REGIONS = 3
# points: entry, the PDL wait returned (the route: its logits stored), the main loop and partial stores done (the
# route: the arrival), the arrival (the route: its top-k), the end, and (a GEMM rotating x itself) warp 0's part of
# that prologue done; the flags: 2 | 1 where the CTA arrived last
TRACE_ENTRY, TRACE_WAITED, TRACE_LOOP, TRACE_ARRIVED, TRACE_END, TRACE_PROLOGUE = range(6)
TRACE_LIVE, TRACE_LAST = 2, 1


@dsl_user_op
def _store_globaltimer(addr, *, loc=None, ip=None) -> None:
    _asm_void([Int64(addr).ir_value(loc=loc, ip=ip)],
              "{ .reg .u64 t; mov.u64 t, %globaltimer; st.global.u64 [$0], t; }", "l", loc=loc, ip=ip)


@dsl_user_op
def _store_smid(addr, flags, *, loc=None, ip=None) -> None:
    _asm_void([Int64(addr).ir_value(loc=loc, ip=ip), Int32(flags).ir_value(loc=loc, ip=ip)],
              "{ .reg .u64 t; .reg .u32 s; mov.u32 s, %smid; shl.b32 s, s, 8; or.b32 s, s, $1; cvt.u64.u32 t, s; "
              "st.global.u64 [$0], t; }", "l,r", loc=loc, ip=ip)


@cute.jit
def trace_stamp(region: cutlass.Constexpr, point: cutlass.Constexpr):
    """Where TRACE_ADDR is set: thread 0 stores %globaltimer at ``point`` of its CTA's slots in ``region`` (every
    thread calls it). Nothing otherwise."""
    if cutlass.const_expr(TRACE_ADDR != 0):
        tid, _, _ = cute.arch.thread_idx()
        cta = _trace_cta()
        if tid == 0 and cta < TRACE_REGION_CTAS:
            _store_globaltimer(_trace_slot(region, cta, point))


@cute.jit
def trace_flags(region: cutlass.Constexpr, flags: Int32):
    """Where TRACE_ADDR is set: thread 0 stores its SM id << 8 | ``flags`` in its CTA's last slot of ``region``."""
    if cutlass.const_expr(TRACE_ADDR != 0):
        tid, _, _ = cute.arch.thread_idx()
        cta = _trace_cta()
        if tid == 0 and cta < TRACE_REGION_CTAS:
            _store_smid(_trace_slot(region, cta, TRACE_POINTS - 1), flags)


def _trace_cta():
    bx, by, bz = cute.arch.block_idx()
    gx, gy, _ = cute.arch.grid_dim()
    return (bz * gy + by) * gx + bx


def _trace_slot(region: int, cta, slot: int):
    return Int64(TRACE_ADDR) + (Int64(region * TRACE_REGION_CTAS) + Int64(cta)) * (TRACE_POINTS * 8) + slot * 8
