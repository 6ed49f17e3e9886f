"""Machine code of our kernels, read on the CPU: registers, spills, shared memory and the main loop's SASS.

A kernel is compiled for any arch (``sm_120a`` included) without a GPU; the cubin's ELF holds the register
count, local-memory frame and static shared memory, and ``nvdisasm`` (pip package ``nvidia-cuda-nvdisasm``, the
``sass`` extra) turns its code into SASS. The main loop is the innermost backward branch whose body holds the
most tensor-core instructions; its instructions are counted per pipe and per decoded weight (per lane: one
16x16 tile is 8 weights of each of the 32 lanes). This is the closest thing to an SM120 benchmark we have
without an SM120 GPU: the decode GEMM is issue-bound, so instructions per weight are its cost. Each instruction
also carries ptxas's schedule in its control bits (``Control``): the cycles its warp stalls before the next issue,
and the scoreboards of variable-latency results. A loop's stall cycles are the least time one warp spends on an
iteration when no scoreboard holds it up; with W warps a scheduler, the loop issues at most W instructions in that
time.

    analyze_cubin(cubin, weights_per_mma=...)    -> [KernelSass]   (any cubin)
    gemm_report(config, arch)                     -> KernelSass     (a GemmConfig, compiled here)
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import struct
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

from exl3tool.errors import Exl3Error

PIPES = ("alu", "fma", "tensor", "memory", "other")

# Opcode (the part before the first '.') -> issue pipe. One table, used for every count. ALU: integer and
# logic ops, shifts, byte permutes, compares, selects, moves; FMA: fp32/fp16 arithmetic and integer multiplies
# (IMAD also carries ptxas's IMAD.SHL/IMAD.MOV); tensor: MMA; memory: loads, stores, atomics, shuffles, constant
# loads. Everything else (branches, barriers, special registers, the uniform datapath) is "other".
_PIPE_OPCODES = {
    "alu": (
        "LOP3 LOP SHF SHL SHR PRMT IADD3 IADD VIADD IABS IMNMX VIMNMX ISETP LEA SEL FSEL FSETP FMNMX HSETP2 "
        "HMNMX2 PLOP3 P2R R2P MOV BMSK BREV FLO POPC SGXT F2FP I2IP ICMP FCHK"
    ),
    "fma": "FFMA FADD FMUL FFMA2 FADD2 FMUL2 IMAD IMUL IDP HFMA2 HADD2 HMUL2",
    "tensor": "HMMA IMMA DMMA BMMA QMMA OMMA HGMMA",
    "memory": "LD ST LDG STG LDS STS LDL STL LDSM STSM LDGSTS ATOM ATOMS ATOMG RED LDC LDCU ULDC SHFL",
}
PIPE_OF_OPCODE = {op: pipe for pipe, ops in _PIPE_OPCODES.items() for op in ops.split()}

_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE = 0x2F, 0x11  # .nv.info attributes: (symbol index, value) pairs
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)(.*?);")
_LABEL = re.compile(r"^(\.L\w+):")
_BRANCH_TARGET = re.compile(r"`\((\.L\w+)\)")
_KERNEL_HEADER = re.compile(r"^//-+ \.text\.(\S+) -+")


class SassToolError(Exl3Error):
    """nvdisasm is missing or failed: SASS cannot be read."""


def pipe_of(opcode: str) -> str:
    """The issue pipe of an opcode such as ``IMAD.SHL.U32`` (``PIPES``)."""
    return PIPE_OF_OPCODE.get(opcode.split(".")[0], "other")


# An instruction's last 23 bits (bits 105-127 of the 128-bit word, sm_70 and later): ptxas's schedule.
_CONTROL_SHIFT, _NO_BARRIER = 105, 7


@dataclass(frozen=True)
class Control:
    """ptxas's schedule of one instruction (the control bits): ``stall`` cycles before its warp may issue again,
    ``yields`` (the yield bit, a scheduling hint), the scoreboard its result (``write_barrier``) or its source operands
    (``read_barrier``) release when a variable-latency operation finishes (None: none), and the scoreboards it
    waits for first (``wait_mask``, bit b = scoreboard b)."""

    bits: int = 0

    @classmethod
    def of(cls, encoding: bytes) -> "Control":
        """From the instruction's 16 bytes, as the cubin stores them (little-endian)."""
        return cls(int.from_bytes(encoding, "little") >> _CONTROL_SHIFT)

    @property
    def stall(self) -> int:
        return self.bits & 0xF

    @property
    def yields(self) -> bool:
        return bool(self.bits >> 4 & 1)

    @property
    def write_barrier(self) -> int | None:
        return None if (b := self.bits >> 5 & 7) == _NO_BARRIER else b

    @property
    def read_barrier(self) -> int | None:
        return None if (b := self.bits >> 8 & 7) == _NO_BARRIER else b

    @property
    def wait_mask(self) -> int:
        return self.bits >> 11 & 0x3F


@dataclass(frozen=True)
class Instruction:
    address: int
    opcode: str  # with modifiers: "HMMA.16816.F32"
    operands: str
    control: Control = Control()

    @property
    def root(self) -> str:
        return self.opcode.split(".")[0]

    @property
    def pipe(self) -> str:
        return pipe_of(self.opcode)


@dataclass(frozen=True)
class Loop:
    """Instructions from a backward branch's target to the branch, inclusive (static count: every instruction of
    the body once, whether or not a predicate or forward branch skips it at run time)."""

    instructions: tuple[Instruction, ...]

    @cached_property
    def by_pipe(self) -> dict[str, int]:
        counts = Counter(i.pipe for i in self.instructions)
        return {pipe: counts.get(pipe, 0) for pipe in PIPES}

    @cached_property
    def by_opcode(self) -> dict[str, int]:
        return dict(Counter(i.root for i in self.instructions).most_common())

    @property
    def mmas(self) -> int:
        return self.by_pipe["tensor"]

    @cached_property
    def stall_cycles(self) -> int:
        """ptxas's fixed stalls over the body: the cycles one warp takes for an iteration with no scoreboard wait."""
        return sum(i.control.stall for i in self.instructions)


@dataclass(frozen=True)
class KernelSass:
    """One kernel of a cubin. ``weights_per_mma``: decoded weights per lane per tensor-core instruction (8 per
    tile / MMAs issued per tile), which turns the loop's counts into per-weight figures."""

    name: str
    registers: int
    frame_bytes: int  # local memory per thread (spills, stack)
    static_smem_bytes: int
    dynamic_smem_bytes: int | None  # from the kernel's config (the launch decides it; the cubin does not say)
    instructions: tuple[Instruction, ...]
    main_loop: Loop | None
    weights_per_mma: float | None = None

    @property
    def spill_instructions(self) -> int:
        return sum(i.root in ("LDL", "STL") for i in self.instructions)

    @property
    def smem_per_cta_bytes(self) -> int | None:
        return None if self.dynamic_smem_bytes is None else self.static_smem_bytes + self.dynamic_smem_bytes

    @property
    def loop_weights(self) -> float | None:
        """Weights each lane decodes per main-loop iteration."""
        if self.main_loop is None or self.weights_per_mma is None:
            return None
        return self.main_loop.mmas * self.weights_per_mma

    @property
    def per_weight(self) -> float | None:
        """Main-loop SASS instructions per decoded weight."""
        return None if not self.loop_weights else len(self.main_loop.instructions) / self.loop_weights

    @property
    def per_weight_by_pipe(self) -> dict[str, float] | None:
        if not self.loop_weights:
            return None
        return {pipe: n / self.loop_weights for pipe, n in self.main_loop.by_pipe.items()}

    @property
    def stall_cycles_per_weight(self) -> float | None:
        """Main-loop stall cycles per decoded weight: one warp's least time a weight (``Loop.stall_cycles``)."""
        return None if not self.loop_weights else self.main_loop.stall_cycles / self.loop_weights


def nvdisasm_path() -> str:
    """The nvdisasm binary: on PATH, or from the ``nvidia-cuda-nvdisasm`` wheel (``nvidia/*/bin/nvdisasm``)."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia  # namespace package of NVIDIA's CUDA wheels

        roots = list(nvidia.__path__)
    except ImportError:
        roots = []
    for root in roots:
        for candidate in sorted(glob.glob(os.path.join(root, "*", "bin", "nvdisasm"))):
            if os.access(candidate, os.X_OK):
                return candidate
    raise SassToolError(
        "nvdisasm not found: install the sass extra (pip install 'exl3tool[sass]', i.e. nvidia-cuda-nvdisasm)"
    )


def compile_cubin(build: Callable[[str], Any], arch: str) -> bytes:
    """The cubin of ``build(options)`` compiled for ``arch`` (no GPU needed; the dump goes to a throwaway folder)."""
    from exl3tool.kernels.ptx import compiling_for

    with tempfile.TemporaryDirectory(prefix="exl3tool-cubin-") as dump, compiling_for(arch):
        return bytes(build(f"--gpu-arch={arch} --keep-cubin --dump-dir={dump}").__cubin__)


def _sections(cubin: bytes) -> dict[str, tuple[int, int, int]]:
    """ELF64 section name -> (offset, size, sh_info)."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise SassToolError("not a 64-bit ELF cubin")
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    entsize, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * entsize) for i in range(count)]
    names_offset = headers[names_index][4]

    def name(offset):
        start = names_offset + offset
        return cubin[start : cubin.index(b"\0", start)].decode()

    return {name(h[0]): (h[4], h[5], h[7]) for h in headers}


def _symbol_attributes(cubin: bytes, data: bytes) -> dict[tuple[int, int], int]:
    """(attribute, symbol index) -> value for the per-symbol records of an .nv.info section."""
    out, pos = {}, 0
    while pos + 4 <= len(data):
        fmt, attr = data[pos], data[pos + 1]
        if fmt == 0x04:  # EIFMT_SVAL: u16 size + payload
            size = struct.unpack_from("<H", data, pos + 2)[0]
            if size == 8:
                symbol, value = struct.unpack_from("<II", data, pos + 4)
                out[(attr, symbol)] = value
            pos += 4 + size
        else:  # EIFMT_NVAL / BVAL / HVAL: 4 bytes in all
            pos += 4
    return out


def _resources(cubin: bytes) -> dict[str, tuple[int, int, int]]:
    """Kernel name -> (registers, frame bytes, static shared bytes)."""
    sections = _sections(cubin)
    attrs = {}
    for name, (offset, size, _) in sections.items():
        if name == ".nv.info" or name.startswith(".nv.info."):
            attrs.update(_symbol_attributes(cubin, cubin[offset : offset + size]))
    out = {}
    for name, (_, _, info) in sections.items():
        if name.startswith(".text."):
            kernel = name[len(".text.") :]
            symbol = info & 0xFFFFFF
            static_smem = sections.get(f".nv.shared.{kernel}", (0, 0, 0))[1]
            out[kernel] = (
                attrs.get((_EIATTR_REGCOUNT, symbol), info >> 24),
                attrs.get((_EIATTR_FRAME_SIZE, symbol), 0),
                static_smem,
            )
    return out


def disassemble(cubin: bytes) -> dict[str, tuple[tuple[Instruction, ...], dict[str, int], list[tuple[int, str]]]]:
    """Kernel name -> (instructions, label -> address, (address, target label) of every branch)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        run = subprocess.run([nvdisasm_path(), "-c", f.name], capture_output=True, text=True)
    if run.returncode != 0:
        raise SassToolError(f"nvdisasm failed: {run.stderr.strip()[:500]}")
    sections = _sections(cubin)
    kernels, current, code, pending_labels = {}, None, b"", []
    for line in run.stdout.splitlines():
        if m := _KERNEL_HEADER.match(line):
            current = kernels.setdefault(m.group(1), ([], {}, []))
            offset, size, _ = sections.get(f".text.{m.group(1)}", (0, 0, 0))
            code = cubin[offset : offset + size]
        elif current is None:
            continue
        elif m := _LABEL.match(line):
            pending_labels.append(m.group(1))
        elif m := _INSTRUCTION.match(line):
            address = int(m.group(1), 16)
            inst = Instruction(address, m.group(2), m.group(3).strip(), Control.of(code[address : address + 16]))
            current[0].append(inst)
            for label in pending_labels:
                current[1][label] = inst.address
            pending_labels = []
            if inst.root == "BRA" and (t := _BRANCH_TARGET.search(inst.operands)):
                current[2].append((inst.address, t.group(1)))
    return {name: (tuple(ins), labels, branches) for name, (ins, labels, branches) in kernels.items()}


def main_loop(instructions, labels, branches) -> Loop | None:
    """The innermost loop holding tensor-core instructions (a backward branch with no such loop inside: an mbarrier
    wait's retry loop inside it does not count) with the most of them."""
    spans = [(labels[t], a) for a, t in branches if t in labels and labels[t] <= a]
    loops = {s: Loop(tuple(i for i in instructions if s[0] <= i.address <= s[1])) for s in spans}
    spans = [s for s in spans if loops[s].mmas]
    innermost = [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]
    return max((loops[s] for s in innermost), key=lambda loop: loop.mmas, default=None)


def analyze_cubin(
    cubin: bytes, weights_per_mma: float | None = None, dynamic_smem_bytes: int | None = None
) -> list[KernelSass]:
    resources = _resources(cubin)
    out = []
    for name, (instructions, labels, branches) in disassemble(cubin).items():
        registers, frame, static_smem = resources.get(name, (0, 0, 0))
        out.append(
            KernelSass(
                name=name,
                registers=registers,
                frame_bytes=frame,
                static_smem_bytes=static_smem,
                dynamic_smem_bytes=dynamic_smem_bytes,
                instructions=instructions,
                main_loop=main_loop(instructions, labels, branches),
                weights_per_mma=weights_per_mma,
            )
        )
    return out


def gemm_report(config, arch: str = "sm_120a") -> KernelSass:
    """The decode GEMM of a ``GemmConfig`` (dense) or ``MoEGemmConfig`` (a route block's) compiled for ``arch``,
    analysed."""
    from exl3tool.kernels.trellis import mmas_per_tile
    from exl3tool.ops import launch, moe_kernels

    build = {**launch.BUILDERS, **moe_kernels.BUILDERS}[type(config)]
    cubin = compile_cubin(lambda options: build(config, options), arch)
    # weights decoded per tensor instruction: a warp's 16x16 tile per HMMA per token group, per HGMMA (warpgroup)
    mmas = 1 if getattr(config, "mma", "sync") == "wgmma" else (
        config.token_groups * mmas_per_tile(getattr(config, "split_halves", False)))
    (kernel,) = analyze_cubin(cubin, weights_per_mma=8 / mmas, dynamic_smem_bytes=config.smem_bytes)
    return kernel
