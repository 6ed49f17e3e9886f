"""What to measure: `BenchRequest`, parsed and checked from the command line's strings before any GPU work."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from exl3tool.errors import UsageError
from exl3tool.format import HALF_RATE_WORDS, Codebook, words_from_bits

PEERS = ("exllamav3",)  # optional peers; torch fp16 and dequant+fp16 always run
PEER_HINT = {
    "exllamav3": "pip install exllamav3 (on the project's GPU machine: source ../shared/peer/build.sh)",
}
# the torch extension a peer compiles on its first import (torch.utils.cpp_extension.load's name)
PEER_EXTENSIONS = {"exllamav3": "exllamav3_ext"}
DTYPES = ("float16", "bfloat16")


@dataclass(frozen=True)
class MoESpec:
    experts: int
    top_k: int
    hidden: int
    intermediate: int

    def __str__(self) -> str:
        return f"{self.experts}:{self.top_k}:{self.hidden}:{self.intermediate}"


@dataclass(frozen=True)
class BenchRequest:
    """One of: ``shapes`` (synthetic linears), ``moe`` (synthetic MoE blocks), ``model`` + ``layer`` (a real
    layer's distinct linears and its MLP/MoE block). ``bits`` and ``codebook`` apply to the synthetic ones."""

    shapes: tuple[tuple[int, int], ...] = ()
    moe: tuple[MoESpec, ...] = ()
    model: str | None = None
    layer: int | None = None
    revision: str | None = None
    bits: tuple[float, ...] = (4.0,)
    codebook: str = "mcg"
    tokens: tuple[int, ...] = (1, 16, 256, 4096)
    modes: tuple[str, ...] = ("graph",)
    peers: tuple[str, ...] = ()
    device: str = "cuda"
    dtype: str = "float16"
    seed: int = 0
    replays: int = 30

    def __post_init__(self):
        if self.model is None and self.layer is not None:
            raise UsageError("--layer needs MODEL")
        if self.model is not None and self.layer is None:
            raise UsageError("MODEL needs --layer N")
        if self.model is not None and (self.shapes or self.moe):
            raise UsageError("give MODEL --layer N, or --shape / --moe, not both")
        if not (self.model or self.shapes or self.moe):
            raise UsageError("nothing to measure: give --shape, --moe or MODEL --layer N")
        for k in self.bits:
            check_bits(k, self.codebook)
        if not self.tokens or min(self.tokens) < 1:
            raise UsageError("--tokens must be positive integers")
        if not self.modes or set(self.modes) - {"graph", "eager"}:
            raise UsageError("--mode must be graph, eager or both")
        if self.dtype not in DTYPES:
            raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}")
        if self.replays < 5:
            raise UsageError("--replays must be at least 5")
        for peer in self.peers:
            if peer not in PEERS:
                raise UsageError(f"unknown peer {peer!r}: choose from {', '.join(PEERS)}")


def check_bits(bits: float, codebook: str) -> None:
    if codebook not in {c.value for c in Codebook}:
        raise UsageError(f"--codebook must be one of {', '.join(c.value for c in Codebook)}, not {codebook!r}")
    try:
        words_from_bits(bits)
    except ValueError:
        raise UsageError(f"--bits {bits:g} is not an EXL3 bitrate (1..8, or 1.5/2.5/3.5 with mul1)") from None
    if bits in HALF_RATE_WORDS.values() and codebook != Codebook.MUL1.value:
        raise UsageError(f"--bits {bits:g} exists for the mul1 codebook only")


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.replace(" ", "").split(",") if v)
    except ValueError:
        raise UsageError(f"{what} must be comma-separated integers, not {text!r}") from None
    if not values or min(values) < 1:
        raise UsageError(f"{what} must be positive integers, not {text!r}")
    return values


def parse_tokens(text: str) -> tuple[int, ...]:
    return tuple(sorted(set(_ints(text, "--tokens"))))


def parse_bits(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.replace(" ", "").split(",") if v)
    except ValueError:
        raise UsageError(f"--bits must be comma-separated numbers, not {text!r}") from None
    if not values:
        raise UsageError("--bits is empty")
    return tuple(dict.fromkeys(values))


def parse_shape(text: str) -> tuple[int, int]:
    """``INxOUT`` (the linear's in_features x out_features)."""
    parts = text.lower().replace(" ", "").split("x")
    try:
        in_f, out_f = (int(p) for p in parts)
    except ValueError:
        raise UsageError(f"--shape must be INxOUT, e.g. 4096x14336, not {text!r}") from None
    if min(in_f, out_f) < 1:
        raise UsageError(f"--shape dims must be positive, not {text!r}")
    return in_f, out_f


def parse_moe(text: str) -> MoESpec:
    """``EXPERTS:TOPK:HIDDEN:INTERMEDIATE``."""
    parts = text.replace(" ", "").split(":")
    try:
        spec = MoESpec(*(int(p) for p in parts))
    except (TypeError, ValueError):
        raise UsageError(f"--moe must be EXPERTS:TOPK:HIDDEN:INTERMEDIATE, e.g. 128:8:2048:768, not {text!r}") \
            from None
    if min(spec.experts, spec.top_k, spec.hidden, spec.intermediate) < 1 or spec.top_k > spec.experts:
        raise UsageError(f"--moe {text}: every field must be positive and TOPK <= EXPERTS")
    return spec


def parse_modes(text: str) -> tuple[str, ...]:
    modes = {"graph": ("graph",), "eager": ("eager",), "both": ("graph", "eager")}.get(text.strip().lower())
    if modes is None:
        raise UsageError(f"--mode must be graph, eager or both, not {text!r}")
    return modes


def require_peers(peers) -> None:
    """Every requested peer can be imported (looked up without importing it: ExLlamaV3 builds its CUDA
    extension on first import), and no build lock stands in the way of that import."""
    for peer in peers:
        if importlib.util.find_spec(peer) is None:
            raise UsageError(f"--peer {peer}: {peer} is not importable; {PEER_HINT[peer]}")
        lock = peer_build_lock(peer)
        if lock is not None:
            raise UsageError(f"--peer {peer}: its CUDA extension's build lock {lock} exists: another build is "
                             "running, or one was interrupted (then delete the file)")


def peer_build_lock(peer: str) -> Path | None:
    """The lock file in the peer extension's build folder, if there is one. torch writes it for the length of a
    build; a build that is killed leaves it behind, and every later import then waits for it without a word."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(PEER_EXTENSIONS[peer], False)) / "lock"
    return lock if lock.exists() else None


def require_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib: pip install 'exl3tool[plot]'")
