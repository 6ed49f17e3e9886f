"""Trellis decode as executed by one lane of a warp: the device algorithm, written once.

A 16x16 EXL3 tile is a ring of ``256*K`` bits held in ``8K`` 32-bit words. Lane ``t`` of a warp owns tile
positions ``8t .. 8t+7`` (the mma.m16n8k16 fragment order, format doc section 4), whose 16-bit states are
windows ending at ring bits ``8tK + c_j`` (``c_j`` below). All eight windows of a lane lie inside three
consecutive ring words, so a lane loads those words, funnel-shifts them once so its first window starts at
bit 0, and then cuts every state out at a compile-time offset. Where windows come in pairs 16 bits apart (K=4, 8),
it may instead hash each pair from the one 32-bit word holding both (``Links``: fewer ALU-pipe instructions).

The functions here take an ``ops`` namespace: ``kernels.ptx`` when traced into a CuTe DSL kernel, and
``kernels.emulate`` (NumPy, bit-exact uint32 semantics) on the CPU. CI runs the emulated path against the
torch reference, so the instruction sequence the GPU executes is checked without a GPU.
"""

from dataclasses import dataclass
from functools import cached_property

CODEBOOKS = ("3inst", "mcg", "mul1")
SUPPORTED_BITS = (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0)

# Codebook constants (format doc section 4.3).
INST3_MUL, INST3_ADD = 89226354, 64248484
MCG_MUL = 0xCBAC1FED
MUL1_MUL = 0x83DCD12D
FP16_MASK, FP16_FLIP = 0x8FFF8FFF, 0x3B603B60
MUL1_INV_X2, MUL1_BIAS_X2 = 0x1EEE1EEE, 0xC931C931  # fp16 pairs: k_inv, k_bias
FP16_1024 = 0x6400  # fp16 bits of 1024.0: dp4a adds the byte sum to it exactly


@dataclass(frozen=True)
class TrellisPlan:
    """Compile-time facts of one bitrate: where each of a lane's 8 windows sits."""

    bits: float
    paired: bool = True  # hash paired windows where the bitrate has them (``links``)

    def __post_init__(self):
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"unsupported trellis bitrate K={self.bits}")

    @property
    def words_per_tile(self) -> int:
        return int(8 * self.bits)

    @property
    def lane_stride_bits(self) -> int:
        """Ring bits between the windows of lane t and lane t+1 (8 weights of K bits)."""
        return int(8 * self.bits)

    @cached_property
    def ends(self) -> tuple[int, ...]:
        """``c_j``: window j of lane t ends at ring bit ``8tK + c_j``. Half rates add one extra bit on odd
        weights (0xAAAA pattern), so weight i ends at ``(i+1)A + (i+1)//2``."""
        whole = int(self.bits)
        if self.bits == whole:
            return tuple((j + 1) * whole for j in range(8))
        return tuple((j + 1) * whole + (j + 1) // 2 for j in range(8))

    @property
    def first_window_offset(self) -> int:
        return self.ends[0] - 16

    @cached_property
    def deltas(self) -> tuple[int, ...]:
        """Start of window j relative to window 0 (compile-time shift amounts)."""
        return tuple(c - self.ends[0] for c in self.ends)

    @cached_property
    def raw_words(self) -> int:
        """Ring words a lane must load: enough for the worst lane alignment."""
        span = self.deltas[-1] + 16
        worst = max((t * self.lane_stride_bits + self.first_window_offset) % 32 for t in range(32))
        words = -(-(worst + span) // 32)
        assert words <= 3, "a lane's windows must fit in three ring words"
        return words

    @cached_property
    def stream_words(self) -> int:
        """Words of the lane's shifted stream that the windows touch."""
        return -(-(self.deltas[-1] + 16) // 32)

    @property
    def fixed_shift(self) -> int | None:
        """The first window's bit offset in the lane's first raw word when it is the same for every lane (8K a
        multiple of 32: K=4, 8); then the windows are cut from the raw words and no runtime alignment is needed."""
        return self.first_window_offset % 32 if self.lane_stride_bits % 32 == 0 else None

    @cached_property
    def cuts(self) -> "Cuts":
        return plan_cuts(self)

    @cached_property
    def links(self) -> "Links | None":
        return plan_links(self) if self.paired else None


@dataclass(frozen=True)
class Cuts:
    """How a lane cuts its 8 windows (compile time). Source words: the raw words when ``fixed_shift`` is known,
    else the stream aligned to window 0 by one runtime funnel shift per word. A *base* is a source word shifted
    left by a constant (``bases[i] = (bit offset, "word" | "shl" | "shf")``: free, IMAD.SHL on the FMA pipe, or
    one funnel shift); window j is bytes ``byte .. byte+1`` (from the top) of base ``windows[j] = (i, byte)``,
    one SHR or PRMT. So a lane pays one instruction per window plus one per non-word base."""

    aligned: bool  # source = stream aligned at runtime (False: raw words)
    bases: tuple[tuple[int, str], ...]
    windows: tuple[tuple[int, int], ...]

    @property
    def fma_instructions(self) -> int:
        """IMAD.SHL bases issue on the FMA pipe; funnel shifts, SHR and PRMT on the ALU."""
        return sum(kind == "shl" for _, kind in self.bases)

    @property
    def instructions(self) -> int:
        return len(self.windows) + sum(kind != "word" for _, kind in self.bases) + (
            len({offset // 32 for offset, _ in self.bases} | {offset // 32 + 1 for offset, k in self.bases
                                                             if k == "shf"}) if self.aligned else 0
        )


def plan_cuts(plan: TrellisPlan) -> Cuts:
    """The fewest instructions that cut every window, then the fewest on the FMA pipe (exhaustive over sets of
    bases; at most 8 windows). H200, M = 1, K=4 mcg: all-ALU cuts (three funnel shifts) ran the GEMM in 18.4-18.7
    us, ALU/FMA-balanced ones (IMAD.SHL bases, top halves by IMAD.HI) in 19.6-19.8, although the ALU pipe
    issues the most there."""
    from itertools import combinations

    aligned = plan.fixed_shift is None
    starts = [(0 if aligned else plan.fixed_shift) + d for d in plan.deltas]
    n_words = plan.stream_words if aligned else plan.raw_words
    candidates = sorted({p - 8 * b for p in starts for b in range(3) if p - 8 * b >= 0})
    free = [c for c in candidates if c % 32 == 0 and c // 32 < n_words]
    paid = [c for c in candidates if c not in free]

    def realize(chosen):
        """Assign windows to bases (nearest base below), then each base's cheapest kind; None if impossible."""
        assignment = []
        for p in starts:
            options = [c for c in chosen if p - c in (0, 8, 16)]
            if not options:
                return None
            assignment.append(max(options))
        bases = []
        for c in sorted(set(assignment)):
            end = max(p + 16 for p, a in zip(starts, assignment) if a == c)
            if c % 32 == 0:
                kind = "word"
            elif end <= 32 * (c // 32 + 1):
                kind = "shl"
            elif c // 32 + 1 < n_words:
                kind = "shf"
            else:
                return None
            bases.append((c, kind))
        index = {c: i for i, (c, _) in enumerate(bases)}
        return Cuts(aligned, tuple(bases), tuple((index[a], (p - a) // 8) for p, a in zip(starts, assignment)))

    best, best_k = None, None
    for k in range(len(paid) + 1):
        if best_k is not None and k > best_k + 1:  # each further base costs one more than it can save
            break
        for extra in combinations(paid, k):
            cuts = realize(free + list(extra))
            if cuts is not None:
                score = (cuts.instructions, cuts.fma_instructions)
                if best is None or score < best[0]:
                    best, best_k = (score, cuts), k
    assert best is not None, f"no way to cut the windows of K={plan.bits}"
    return best[1]


@dataclass(frozen=True)
class Links:
    """Paired hashes (compile time), for bitrates whose lane windows come in pairs 16 bits apart. The 32-bit stream
    word starting at head window i holds w_i in its top half and the window j 16 bits later in its bottom half, so

        hash(w_j) = word * MUL + ADD - w_i * (MUL << 16)   (mod 2^32)

    two IMADs (FMA pipe) instead of a cut (ALU pipe); w_i itself is the word's top half (one SHR). ``pairs``:
    (head i, window j, word offset in the raw words); a word at an offset not a multiple of 32 is one funnel shift.
    K=4: three funnel shifts and four SHR for eight windows, against eleven ALU cuts."""

    pairs: tuple[tuple[int, int, int], ...]

    @property
    def alu_instructions(self) -> int:
        return sum(1 + (offset % 32 != 0) for _, _, offset in self.pairs)

    @property
    def instructions(self) -> int:
        """The lane's whole hash work: cuts and word shifts, then one IMAD per head and two per linked window."""
        return self.alu_instructions + 3 * len(self.pairs)


def plan_links(plan: TrellisPlan) -> Links | None:
    """Pair every window with one 16 bits after or before it (raw words only: ``fixed_shift`` known), if that
    costs no more instructions than ``plan.cuts`` and a hash a window; else None."""
    if plan.fixed_shift is None:
        return None
    starts = [plan.fixed_shift + d for d in plan.deltas]
    pairs, linked = [], set()
    for i, p in enumerate(starts):
        if i in linked or p + 16 not in starts:
            continue
        j = starts.index(p + 16)
        if j in linked:
            continue
        if p % 32 and p // 32 + 1 >= plan.raw_words:
            return None
        pairs.append((i, j, p))
        linked |= {i, j}
    if len(linked) != len(starts):
        return None
    links = Links(tuple(pairs))
    return links if links.instructions <= plan.cuts.instructions + len(starts) else None


def lane_word_indices(plan: TrellisPlan, lane):
    """Ring word indices a lane loads, and the bit shift that aligns its first window to bit 0.

    ``lane`` may be a DSL Int32 or a NumPy int array; the arithmetic is the same for both.
    """
    first_bit = lane * plan.lane_stride_bits + plan.first_window_offset  # < 0 only for lane 0: wraps
    word = first_bit >> 5
    shift = first_bit & 31
    n = plan.words_per_tile
    indices = tuple((word + k + n) % n for k in range(plan.raw_words))
    return indices, shift


def lane_states(plan: TrellisPlan, words, shift, ops):
    """The eight 16-bit states of a lane from its raw ring words (``lane_word_indices`` order), cut as
    ``plan.cuts`` says: at most one funnel shift per source word, one per extra base, one per window."""
    cuts = plan.cuts
    source = {}

    def word(q):
        if q not in source:
            if not cuts.aligned:
                source[q] = words[q]
            elif q + 1 < len(words):
                source[q] = ops.shf_l(words[q + 1], words[q], shift)
            else:
                source[q] = ops.shl(words[q], shift)
        return source[q]

    bases = []
    for offset, kind in cuts.bases:
        q, r = divmod(offset, 32)
        if kind == "word":
            bases.append(word(q))
        elif kind == "shl":
            bases.append(ops.shl_imm(word(q), r))
        else:
            bases.append(ops.shf_l_imm(word(q + 1), word(q), r))
    return [ops.cut16(bases[i], byte) for i, byte in cuts.windows]


def codebook_constants(codebook: str, ops):
    """Registers the codebook needs, made once per kernel (outside the main loop)."""
    return () if codebook == "mul1" else (ops.pinned(FP16_FLIP),)


def hash_constants(codebook: str) -> tuple[int, int]:
    """(MUL, ADD) of the codebook's hash ``state * MUL + ADD`` (mod 2^32)."""
    if codebook == "mcg":
        return MCG_MUL, 0
    if codebook == "3inst":
        return INST3_MUL, INST3_ADD
    if codebook == "mul1":
        return MUL1_MUL, 0
    raise ValueError(f"unknown codebook {codebook!r}")


def _hash(x, mul: int, add: int, ops):
    return ops.mad_lo_imm(x, mul, add) if add else ops.mul_lo_imm(x, mul)


def lane_hashes(plan: TrellisPlan, codebook: str, words, shift, ops):
    """The lane's 8 hashed states ``state * MUL + ADD``: by ``plan.links`` where it has them (paired words), else
    each state cut (``lane_states``) and multiplied."""
    mul, add = hash_constants(codebook)
    links = plan.links
    if links is None:
        return [_hash(s, mul, add, ops) for s in lane_states(plan, words, shift, ops)]
    hashed = [None] * 8
    for i, j, offset in links.pairs:
        q, r = divmod(offset, 32)
        word = words[q] if r == 0 else ops.shf_l_imm(words[q + 1], words[q], r)
        head = ops.cut16(word, 0)
        hashed[i] = _hash(head, mul, add, ops)
        hashed[j] = ops.mad_lo_imm_add(head, (-(mul << 16)) & 0xFFFFFFFF, _hash(word, mul, add, ops))
    return hashed


def hashes_to_half2(codebook: str, hashed, ops, consts):
    """Codebook: 8 hashes -> 4 packed fp16 pairs (pair p holds weights 2p, 2p+1; lower index in the low half)."""
    if codebook == "mul1":
        sums = [ops.dp4a_bytesum(x, FP16_1024) for x in hashed]
        pairs = []
        for p in range(4):
            packed = ops.prmt_imm(sums[2 * p], sums[2 * p + 1], 0x5410)
            pairs.append(ops.hfma2_imm(packed, MUL1_INV_X2, MUL1_BIAS_X2))
        return pairs
    (flip,) = consts
    masked = [ops.and_xor(x, FP16_MASK, flip) for x in hashed]
    return [ops.half_sums(masked[2 * p], masked[2 * p + 1]) for p in range(4)]


def hashes_to_halves(codebook: str, hashed, ops, consts):
    """mcg / 3inst without the final fp16 add: register j holds the two fp16 halves whose sum is weight j."""
    if codebook not in ("mcg", "3inst"):
        raise ValueError(f"the {codebook} codebook has no unsummed halves")
    (flip,) = consts
    return [ops.and_xor(x, FP16_MASK, flip) for x in hashed]


def decode_lane(plan: TrellisPlan, codebook: str, words, shift, ops, consts):
    """Lane's 8 weights as 4 fp16x2 registers: (w0,w1), (w2,w3), (w4,w5), (w6,w7).

    ``consts`` comes from ``codebook_constants`` (hoisted out of the loop by the caller)."""
    return hashes_to_half2(codebook, lane_hashes(plan, codebook, words, shift, ops), ops, consts)


def decode_lane_halves(plan: TrellisPlan, codebook: str, words, shift, ops, consts):
    """Lane's 8 weights as unsummed fp16 half pairs (``hashes_to_halves``): for ``split_halves_fragments``."""
    return hashes_to_halves(codebook, lane_hashes(plan, codebook, words, shift, ops), ops, consts)


def mmas_per_tile(split_halves: bool = False) -> int:
    """Tensor-core instructions a decoded 16x16 tile feeds per 8 tokens."""
    return 2 if split_halves else 1


def doubled_b(b, ops):
    """The lane's four doubled B words of a k-tile, ``(x[2q], x[2q]), (x[2q+8], x[2q+8]), (x[2q+1], x[2q+1]),
    (x[2q+9], x[2q+9])`` (MMA 0's B register pair, then MMA 1's), from its two B words ``(x[2q], x[2q+1]),
    (x[2q+8], x[2q+9])``: what X in ``doubled`` order holds already (one swizzled HADD2 each)."""
    return [ops.dup_half(w, h) for h in (0, 1) for w in b]


def split_halves_fragments(halves, d, ops):
    """Two MMAs that add each weight's two fp16 halves in the tensor core instead of an HADD2 + PRMT per pair:
    in MMA m, k-slots (2q, 2q+1) of row n hold the halves of weight (k = 2q + m, n) and B holds x[2q + m] in
    both slots (likewise 2q+8+m). Returns ((a, b) of MMA 0, (a, b) of MMA 1) from the lane's four doubled B words
    ``d`` (``doubled_b``). The weight is then never rounded to fp16 (exact fp32 sums)."""
    return tuple(((halves[m], halves[4 + m], halves[2 + m], halves[6 + m]), (d[2 * m], d[2 * m + 1]))
                 for m in range(2))


# Column orders of the GEMM's rotated input X (GemmConfig.x_order): "rows" (x as is), "fragments" (each lane's B
# words of a k-tile pair side by side), "doubled" (every element as an fp16 pair (x, x), each lane's four words
# of a k-tile side by side: split halves' B operands, one 16-byte load per k-tile) and "stages" (the warpgroup-MMA
# GEMM's shared-memory stage layout, ``x_stages_index``: a stage of a route block is one contiguous bulk copy).
X_ORDERS = ("rows", "fragments", "doubled", "stages")
STAGE_K = 64  # k values of one 128-byte swizzled row of a wgmma X stage ("stages" order)


def wgmma_swizzled_piece(row, piece):
    """Where 16-byte piece ``piece`` (0..7) of token row ``row`` of a 128-byte swizzled atom sits (the warpgroup MMA's
    B layout, ``ptx.wgmma_descriptor_high``): ``row % 8`` as a mask (rows are never negative; a signed remainder
    costs the rotations' stores instructions)."""
    return piece ^ (row & 7)


def x_stages_index(row, e, rows):
    """fp16 index of element ``e`` of row ``row`` in an X of ``rows`` rows in "stages" order: 64-column chunks one
    after the other (chunk-major: a chunk's rows contiguous, 128 bytes each) and in each row the 16-byte piece p of
    the chunk at ``wgmma_swizzled_piece(row, p)``: the 128-byte swizzle the warpgroup MMA reads, so the rows of a
    route block form one stage as they are. Arguments as in ``x_fragment_slot`` (``rows`` too)."""
    r = e % STAGE_K
    return ((e // STAGE_K) * rows + row) * STAGE_K + wgmma_swizzled_piece(row, r >> 3) * 8 + (r & 7)


def x_fragment_slot(e):
    """fp16 slot of a row's element ``e`` in fragment order: lane quad q's B words of a k-tile pair (16 fp16:
    ``x[2q], x[2q+1], x[2q+8], x[2q+9]`` of the first k-tile, then of the second) lie at words ``16c + 4q ..
    16c + 4q + 3`` of pair c, one 16-byte load. ``e`` may be a DSL Int32 or a NumPy int array."""
    r = e & 15
    q, hi8, odd = (r & 7) >> 1, r >> 3, r & 1
    return 2 * (((e >> 5) << 4) + 4 * q + 2 * ((e >> 4) & 1) + hi8) + odd


def x_doubled_word(e):
    """32-bit word of a row's element ``e`` in doubled order: lane quad q's words ``(x[2q], x[2q]), (x[2q+8], ..),
    (x[2q+1], ..), (x[2q+9], ..)`` of k-tile t (``doubled_b``) lie at words ``16t + 4q .. 16t + 4q + 3``: one
    16-byte load gives both MMAs' B register pairs. ``e`` as in ``x_fragment_slot``."""
    r = e & 15
    return ((e >> 4) << 4) + 4 * ((r & 7) >> 1) + 2 * (r & 1) + (r >> 3)


def x_row_halves(in_p: int, x_order: str) -> int:
    """fp16 values in a row of X: ``in_p``, twice that in doubled order."""
    return 2 * in_p if x_order == "doubled" else in_p


def x_pair_word(e, x_order: str):
    """The 32-bit word of an X row holding its even column ``e`` and column ``e + 1`` (a pair stays one word in
    rows and fragment order), in ``x_order``: what every writer of a GEMM input uses. ``e`` as in
    ``x_fragment_slot``."""
    if x_order == "doubled":
        raise ValueError("doubled order has one word per element (x_doubled_word)")
    return e // 2 if x_order == "rows" else x_fragment_slot(e) // 2


def mma_a_fragment(pairs):
    """The lane's pairs in the A-operand order of ``mma.m16n8k16`` with A = W_hat^T (rows = output columns).

    Pairs 0/1 hold tile column ``t//4`` (rows 2c.. and 2c+8..), pairs 2/3 column ``t//4 + 8``; A's register order
    is (row g, k lo), (row g+8, k lo), (row g, k hi), (row g+8, k hi).
    """
    return (pairs[0], pairs[2], pairs[1], pairs[3])


def tile_position(lane: int, j: int) -> tuple[int, int]:
    """(row, col) inside the 16x16 tile of lane ``lane``'s weight ``j`` (row = input, col = output)."""
    return 2 * (lane % 4) + (0, 1, 8, 9)[j % 4], lane // 4 + 8 * (j >= 4)
