"""What `exl3tool bench` measured, as plain dataclasses, the arithmetic behind every derived figure, and the
versioned JSON (`BenchReport.to_json()`, schema ``exl3tool.bench/1``; `SassReport.to_json()`,
``exl3tool.bench.sass/1``). No torch here: the CLI renders and tests build reports without a GPU.

Units: times in microseconds, bandwidth in GB/s (1e9 bytes) and TB/s (1e12), compute in TFLOP/s. A ratio
``vs[peer]`` is the peer's median over this implementation's median in the same case and mode: above 1, this
implementation is faster.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

SCHEMA = "exl3tool.bench/1"
SASS_SCHEMA = "exl3tool.bench.sass/1"
MODES = ("graph", "eager")
# ok: checked, then timed. wrong: failed the reference check, never timed. failed: raised (note says what).
# eager-only: cannot be captured in a CUDA graph (host syncs); its eager row has the timing. skipped: not
# available for this case (note says why).
STATUSES = ("ok", "wrong", "failed", "eager-only", "skipped")


# --- arithmetic ------------------------------------------------------------------------------------------


def floor_us(nbytes: float, copy_tbs: float) -> float:
    """Time to stream ``nbytes`` once at the measured copy bandwidth: no kernel reading them can be faster."""
    return nbytes / (copy_tbs * 1e12) * 1e6


def weight_gbs(nbytes: float, us: float) -> float:
    return nbytes / (us * 1e-6) / 1e9


def pct_of_copy(gbs: float, copy_tbs: float) -> float:
    return 100.0 * gbs / (copy_tbs * 1e3)


def tflops(flops: float, us: float) -> float:
    return flops / (us * 1e-6) / 1e12


def exl3_weight_bytes(in_features: int, out_features: int, bits: float, bias: bool = False) -> int:
    """Bytes an EXL3 linear streams per call: the trellis (K bits per padded weight) plus fp16 suh, svh (and
    bias), at the padded sizes the kernels read."""
    in_p, out_p = -(-in_features // 128) * 128, -(-out_features // 128) * 128
    return int(in_p * out_p * bits / 8) + 2 * (in_p + out_p) + (2 * out_p if bias else 0)


def linear_flops(tokens: int, in_features: int, out_features: int) -> int:
    return 2 * tokens * in_features * out_features


# --- results ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    """Per call, over the timed repetitions: GPU time (median/min/max) and host time to issue the call."""

    median_us: float
    min_us: float
    max_us: float
    host_us: float  # graph: replay() wall time / calls; eager: wall time to enqueue the calls / calls
    repeats: int


@dataclass(frozen=True)
class Check:
    """The implementation's output against the fp32 reference on the same input (before any timing)."""

    rel_l2: float
    cosine: float
    max_abs: float
    passed: bool


@dataclass
class Result:
    implementation: str
    mode: str  # graph | eager
    status: str  # STATUSES
    weight_bytes: int  # what one call of this implementation streams (fp16 peers: 2 bytes per weight)
    copies: int = 1  # weight copies the timed loop rotates through (past 3x the L2 unless capped)
    check: Check | None = None
    compile_s: float | None = None  # first call (compiles kernels, builds plans): never inside a timing
    timing: Timing | None = None
    weight_gbs: float | None = None
    pct_copy_bw: float | None = None
    tflops: float | None = None
    vs: dict[str, float] = field(default_factory=dict)  # peer -> peer median / this median
    note: str = ""


def timed_result(implementation: str, mode: str, timing: Timing, *, weight_bytes: int, flops: int,
                 copy_tbs: float, **fields) -> Result:
    """A measured result with its bandwidth and compute figures derived from the median."""
    gbs = weight_gbs(weight_bytes, timing.median_us)
    return Result(implementation, mode, "ok", weight_bytes, timing=timing, weight_gbs=gbs,
                  pct_copy_bw=pct_of_copy(gbs, copy_tbs), tflops=tflops(flops, timing.median_us), **fields)


def fill_ratios(results: list[Result]) -> None:
    """``vs`` of every timed result: each other timed implementation of the same case and mode."""
    for r in results:
        r.vs = {p.implementation: p.timing.median_us / r.timing.median_us for p in results
                if r.timing is not None and p.timing is not None and p is not r and p.mode == r.mode
                and p.implementation != r.implementation}


@dataclass
class Case:
    """One thing measured at one token count: a linear, a gated MLP or a MoE block."""

    kind: str  # linear | mlp | moe
    name: str  # "4096x14336" for a synthetic linear, the module name for a model's
    in_features: int
    out_features: int
    bits: float | None
    codebook: str | None
    tokens: int
    weight_bytes: int  # EXL3 bytes a call must stream (MoE: the experts the tokens are routed to)
    floor_us: float  # weight_bytes at the copy bandwidth of this run
    flops: int
    results: list[Result] = field(default_factory=list)
    experts: dict | None = None  # MoE: {"experts", "top_k", "touched", "intermediate"}

    @property
    def shape(self) -> str:
        return f"{self.in_features}x{self.out_features}"

    @property
    def group(self) -> str:
        """Cases that differ only in tokens share a group (a table, a plot panel)."""
        parts = [self.kind, self.name if self.name != self.shape else "", self.shape]
        if self.bits is not None:
            parts.append(f"K{self.bits:g}")
        if self.codebook:
            parts.append(self.codebook)
        if self.experts:  # hidden x hidden in and out: name the experts' intermediate size too
            parts.append(f"{self.experts['experts']}e top-{self.experts['top_k']} I={self.experts['intermediate']}")
        return " ".join(p for p in parts if p)


@dataclass(frozen=True)
class Environment:
    gpu: str
    arch: str
    device: str
    sm_count: int
    l2_bytes: int
    copy_tbs: float  # device-to-device copy (bytes read + written per second), measured in this run
    torch: str
    cuda: str | None
    commit: str | None
    date: str  # UTC, ISO 8601
    source: str | None = None  # timing.source_digest() of the code that ran (absent in reports before it)


@dataclass(frozen=True)
class Settings:
    modes: tuple[str, ...]
    replays: int
    l2_multiple: int
    dtype: str
    seed: int
    peers: tuple[str, ...]
    command: str | None = None


@dataclass
class BenchReport:
    environment: Environment
    settings: Settings
    cases: list[Case] = field(default_factory=list)

    @property
    def wrong(self) -> list[tuple[Case, Result]]:
        return [(c, r) for c in self.cases for r in c.results if r.status in ("wrong", "failed")]

    def groups(self) -> dict[str, list[Case]]:
        out: dict[str, list[Case]] = {}
        for c in self.cases:
            out.setdefault(c.group, []).append(c)
        return out

    @classmethod
    def from_json(cls, data: dict) -> "BenchReport":
        """The report a `to_json()` wrote (to render or plot it again elsewhere); ValueError for another schema."""
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise ValueError(f"not an {SCHEMA} report")
        s = data["settings"]
        report = cls(Environment(**data["environment"]),
                     Settings(**{**s, "modes": tuple(s["modes"]), "peers": tuple(s["peers"])}))
        timing_fields = ("median_us", "min_us", "max_us", "host_us", "repeats")
        for c in data["cases"]:
            case = Case(c["kind"], c["name"], c["in_features"], c["out_features"], c["bits"], c["codebook"],
                        c["tokens"], c["weight_bytes"], c["floor_us"], c["flops"], experts=c["experts"])
            for r in c["results"]:
                check = r["check"] and Check(**{k: math.inf if v is None and k != "passed" else v
                                                for k, v in r["check"].items()})
                timing = Timing(*(r[k] for k in timing_fields)) if r["median_us"] is not None else None
                case.results.append(Result(
                    r["implementation"], r["mode"], r["status"], r["weight_bytes"], r["copies"], check,
                    r["compile_s"], timing, r["weight_gbs"], r["pct_copy_bw"], r["tflops"], dict(r["vs"]),
                    r["note"]))
            report.cases.append(case)
        return report

    def to_json(self) -> dict:
        return {
            "schema": SCHEMA,
            "environment": asdict(self.environment),
            "settings": {**asdict(self.settings), "modes": list(self.settings.modes),
                         "peers": list(self.settings.peers)},
            "cases": [_case_json(c) for c in self.cases],
        }


def _finite(value):
    """JSON has no NaN/Infinity: they become null (a NaN output's error, say)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _case_json(c: Case) -> dict:
    return {
        "kind": c.kind, "name": c.name, "group": c.group, "shape": c.shape, "in_features": c.in_features,
        "out_features": c.out_features, "bits": c.bits, "codebook": c.codebook, "tokens": c.tokens,
        "weight_bytes": c.weight_bytes, "floor_us": c.floor_us, "flops": c.flops, "experts": c.experts,
        "results": [{
            "implementation": r.implementation, "mode": r.mode, "status": r.status,
            "check": None if r.check is None else {k: _finite(v) for k, v in asdict(r.check).items()},
            "compile_s": r.compile_s, "copies": r.copies, "weight_bytes": r.weight_bytes,
            **({k: v for k, v in asdict(r.timing).items()} if r.timing else
               {k: None for k in ("median_us", "min_us", "max_us", "host_us", "repeats")}),
            "weight_gbs": r.weight_gbs, "pct_copy_bw": r.pct_copy_bw, "tflops": r.tflops,
            "vs": dict(r.vs), "note": r.note,
        } for r in c.results],
    }


# --- SASS ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SassRow:
    """One kernel compiled for ``arch``: resources, and its main loop per decoded weight (MMA kernels only)."""

    kernel: str  # what it is: "gemm K4 mcg 8 tokens", "dequant K4 mcg", ...
    symbol: str
    registers: int
    spill_bytes: int  # local memory frame per thread
    spill_instructions: int  # LDL/STL in the code
    static_smem_bytes: int
    smem_per_cta_bytes: int | None  # static + dynamic; None where the dynamic part is not known from a config
    loop_instructions: int | None
    per_weight: float | None
    per_weight_by_pipe: dict[str, float] | None
    ctas_per_sm: int | None = None  # resident at once (threads, registers, shared memory); decode GEMMs only
    stall_cycles_per_weight: float | None = None  # ptxas's fixed stalls over the main loop per weight, one warp
    # the share of the schedulers' issue slots the resident warps can fill by those stalls alone (W warps a
    # scheduler x loop SASS / loop stall cycles, at most 1); scoreboard waits lower it further. Decode GEMMs only
    issue_cap: float | None = None


@dataclass(frozen=True)
class SassReport:
    arch: str
    rows: tuple[SassRow, ...]
    sm_count: int | None = None  # the SMs a MoE report's plans assume (targets.typical_sms)

    def to_json(self) -> dict:
        return {"schema": SASS_SCHEMA, "arch": self.arch, "sm_count": self.sm_count,
                "kernels": [asdict(r) for r in self.rows]}
