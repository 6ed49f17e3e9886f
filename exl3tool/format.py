"""The EXL3 format model: constants and plain dataclasses, no IO.

Reading fills these in (`exl3tool.io`), the reference decodes from them (`exl3tool.reference`), and later
stages (prepare, kernels, verify) consume them. See `docs/exl3-format.md` in the project brief for the facts.

    Codebook                  "3inst" | "mcg" | "mul1"
    TensorInfo                one stored tensor: name, file, dtype, shape, nbytes
    LinearInfo                one EXL3 linear: true and padded dims, K (`bits`), codebook, tensors by leaf name
    LinearTensors             the loaded tensors of one linear (trellis, suh, svh, bias)
    GatedMLP                  down(act(gate(x)) * up(x)): a dense MLP, one expert, or the shared experts
    Routing                   how a MoE router picks and weighs experts (from config.json)
    MoEBlock                  router + experts (+ shared experts and their sigmoid gate)
    Attention                 the EXL3 projections of one attention module
    Layer                     one decoder layer: attention, mlp (GatedMLP | MoEBlock | None), other linears
    ModelDims / QuantConfig / ModelConfig   what config.json says
    CheckpointModel           the whole checkpoint: layers, head, other linears, unquantized tensors
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping, Union

if TYPE_CHECKING:  # torch is only needed by those who load tensors
    import torch

# --- constants -------------------------------------------------------------------------------------------

TILE = 16  # a trellis tile is 16 x 16 weights
PAD = 128  # true dims are zero-padded up to a multiple of 128 (the Hadamard block size)
MCG_MARKER = -877912083  # 0xCBAC1FED read as int32
MUL1_MARKER = -2082680531  # 0x83DCD12D read as int32
HALF_RATE_WORDS = {24: 1.5, 40: 2.5, 56: 3.5}  # since ExLlamaV3 1.6.5, mul1 only
LINEAR_LEAVES = frozenset({"trellis", "suh", "svh", "su", "sv", "mcg", "mul1", "bias"})
EXL3_ONLY_LEAVES = LINEAR_LEAVES - {"bias"}  # leaves that only make sense inside an EXL3 linear


class Codebook(str, Enum):
    """How a 16-bit trellis state becomes an fp16 weight."""

    INST3 = "3inst"
    MCG = "mcg"
    MUL1 = "mul1"


def bits_from_words(words: int) -> float | None:
    """K for a trellis whose last dim is `words` (16*K), or None when no K has that many words."""
    if words in HALF_RATE_WORDS:
        return HALF_RATE_WORDS[words]
    if words % TILE == 0 and 1 <= words // TILE <= 8:
        return float(words // TILE)
    return None


def words_from_bits(bits: float) -> int:
    """16*K, the last dim of the trellis for K = `bits`; ValueError for a K that does not exist."""
    words = round(bits * TILE)
    if bits_from_words(words) != bits:
        raise ValueError(f"K={bits} is not an EXL3 bitrate (1..8, or 1.5/2.5/3.5)")
    return words


def padded(n: int) -> int:
    """`n` rounded up to a multiple of 128."""
    return -(-n // PAD) * PAD


def format_bits(bits: float) -> str:
    """'4' for 4.0, '3.5' for 3.5."""
    return str(int(bits)) if float(bits).is_integer() else str(bits)


# --- tensors and linears ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as its safetensors header describes it."""

    name: str
    file: str  # relative to the checkpoint folder
    dtype: str  # safetensors dtype, e.g. "I16", "F16", "BF16"
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class LinearInfo:
    """One EXL3 linear `name` (the module key, e.g. `model.layers.0.self_attn.q_proj`).

    `in_features`/`out_features` are the true sizes from config.json when it determines them
    (`dims_from_config`), else the padded sizes. `tensors` maps a leaf ("trellis", "suh", "svh", "su", "sv",
    "mcg", "mul1", "bias") to the stored tensor, which also tells the file holding it.
    """

    name: str
    in_features: int
    out_features: int
    in_padded: int
    out_padded: int
    bits: float
    codebook: Codebook
    has_bias: bool
    legacy_signs: bool
    tensors: Mapping[str, TensorInfo] = field(default_factory=dict, hash=False, compare=False, repr=False)
    dims_from_config: bool = False

    @property
    def trellis_words(self) -> int:
        """16*K: the last dim of the trellis."""
        return words_from_bits(self.bits)

    @property
    def file(self) -> str:
        """The file holding the trellis."""
        return self.tensors["trellis"].file

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(sorted({t.file for t in self.tensors.values()}))

    @property
    def stored_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def weights(self) -> int:
        """Number of true (unpadded) weights."""
        return self.in_features * self.out_features

    @property
    def effective_bits(self) -> float:
        """Stored bits per true weight, suh/svh/bias/marker included."""
        return self.stored_bytes * 8 / self.weights

    def tensor_name(self, leaf: str) -> str:
        return f"{self.name}.{leaf}"


@dataclass
class LinearTensors:
    """The tensors of one EXL3 linear, loaded. Legacy su/sv are already expanded to +-1 fp16 suh/svh."""

    info: LinearInfo
    trellis: "torch.Tensor"  # int16 (in_p/16, out_p/16, 16K)
    suh: "torch.Tensor"  # fp16 (in_p,)
    svh: "torch.Tensor"  # fp16 (out_p,)
    bias: "torch.Tensor | None" = None  # fp16 (out_p,)

    def to(self, device) -> "LinearTensors":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return LinearTensors(self.info, move(self.trellis), move(self.suh), move(self.svh), move(self.bias))


# --- modules ---------------------------------------------------------------------------------------------


# HF's names of the gated MLPs' activation (transformers' ACT2FN) -> what they compute, the names blocks carry:
# SiLU (Llama, Qwen, Mixtral, DeepSeek, ...) and GELU, exact or in its tanh form (Gemma 2 / 3 gelu_pytorch_tanh;
# gelu_new is the same formula); gpt-oss's clamped SwiGLU, which its model type implies (io.config). Any other name
# is kept as read, and whole blocks with it are refused.
ACTIVATION_KINDS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
                    "gelu_new": "gelu_tanh", "swiglu_oai": "swiglu_oai"}


@dataclass(frozen=True)
class GatedMLP:
    """down(act(gate(x)) * up(x)). `name` is the module key (`model.layers.0.mlp`, `...experts.3`, ...)."""

    name: str
    gate: LinearInfo
    up: LinearInfo
    down: LinearInfo
    activation: str = "silu"
    activation_limit: float | None = None  # swiglu_oai's clamp of gate and up (gpt-oss: swiglu_limit)

    @property
    def linears(self) -> tuple[LinearInfo, ...]:
        return (self.gate, self.up, self.down)


@dataclass(frozen=True)
class Routing:
    """How the router turns logits into expert weights.

    method: "softmax_topk" (softmax over all experts, top-k, optional renormalisation; Qwen, Mixtral, OLMoE),
    "sigmoid_noaux_tc" (DeepSeek-V3 / GLM-4 MoE: sigmoid scores, group-limited top-k on scores + correction
    bias, weights from the scores, optional renormalisation, times `scale`), or "unknown" (recognised as MoE,
    routing not understood: the reference refuses it). `choice_bias`: sigmoid routing chooses by score + a correction
    bias (LFM2-MoE's `use_expert_bias` can turn it off).
    """

    method: str
    num_experts: int
    top_k: int
    normalize: bool
    scale: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    choice_bias: bool = True


@dataclass(frozen=True)
class MoEBlock:
    """A sparse MoE block: fp16 router `(num_experts, hidden)`, one GatedMLP per expert, optional shared ones."""

    name: str
    router: TensorInfo
    experts: tuple[GatedMLP, ...]
    routing: Routing
    shared_experts: GatedMLP | None = None
    shared_expert_gate: TensorInfo | None = None  # (1, hidden): sigmoid(x @ g.T) scales the shared output
    correction_bias: TensorInfo | None = None  # (num_experts,): DeepSeek-V3 e_score_correction_bias
    router_bias: TensorInfo | None = None  # (num_experts,): added to the router's logits (gpt-oss)

    @property
    def linears(self) -> tuple[LinearInfo, ...]:
        out = [lin for e in self.experts for lin in e.linears]
        if self.shared_experts is not None:
            out.extend(self.shared_experts.linears)
        return tuple(out)


Block = Union[GatedMLP, MoEBlock]


@dataclass(frozen=True)
class Attention:
    """The EXL3 projections of one attention module, keyed by their last name part (q_proj, k_proj, ...)."""

    name: str
    projections: Mapping[str, LinearInfo] = field(hash=False)

    @property
    def linears(self) -> tuple[LinearInfo, ...]:
        return tuple(self.projections.values())

    @property
    def kind(self) -> str:
        """"linear" for a gated delta-net (`linear_attn`: Qwen3-Next, Qwen3.5), "conv" for a short convolution
        (`conv`: LFM2), else "full"."""
        return {"linear_attn": "linear", "conv": "conv"}.get(self.name.rsplit(".", 1)[-1], "full")


@dataclass(frozen=True)
class Layer:
    """One decoder layer. `other_linears`: EXL3 linears that are neither attention nor a whole MLP/MoE block
    (e.g. sliced MLP projections `mlp.gate_proj.slice.0`)."""

    index: int
    attention: Attention | None
    mlp: Block | None
    other_linears: tuple[LinearInfo, ...] = ()

    @property
    def linears(self) -> tuple[LinearInfo, ...]:
        out: list[LinearInfo] = []
        if self.attention is not None:
            out.extend(self.attention.linears)
        if self.mlp is not None:
            out.extend(self.mlp.linears)
        out.extend(self.other_linears)
        return tuple(out)

    @property
    def blocks(self) -> tuple[Block, ...]:
        """Every block `reference_forward` accepts in this layer: the MLP/MoE block, its experts, shared experts."""
        if self.mlp is None:
            return ()
        if isinstance(self.mlp, GatedMLP):
            return (self.mlp,)
        shared = (self.mlp.shared_experts,) if self.mlp.shared_experts is not None else ()
        return (self.mlp, *self.mlp.experts, *shared)


# --- config ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelDims:
    """The true sizes config.json gives (None where it does not say)."""

    hidden: int | None = None
    intermediate: int | None = None
    # The dense MLPs' width and what config.json calls it: intermediate_size, but LFM2's derived (``_feed_forward``)
    dense_intermediate: int | None = None
    dense_intermediate_key: str = "intermediate_size"
    moe_intermediate: int | None = None
    shared_expert_intermediate: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    vocab: int | None = None
    num_layers: int | None = None
    extra_layers: int = 0  # e.g. DeepSeek-V3's multi-token-prediction layers stored after the last one
    num_experts: int | None = None
    num_shared_experts: int | None = None
    # Gated delta-net (linear attention) heads: Qwen3-Next, Qwen3.5
    linear_key_heads: int | None = None
    linear_value_heads: int | None = None
    linear_key_head_dim: int | None = None
    linear_value_head_dim: int | None = None


@dataclass(frozen=True)
class QuantConfig:
    """config.json's `quantization_config` (quant_method is always "exl3" here)."""

    version: str | None
    bits: float | None
    head_bits: float | None
    codebook: str | None
    extra_keys: tuple[str, ...] = ()  # keys exl3tool does not know (shown, not interpreted)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str | None
    model_type: str | None
    dims: ModelDims
    quant: QuantConfig
    routing: Routing | None  # None for dense models
    tie_word_embeddings: bool = False
    activation: str = "silu"  # the gated MLPs' act(gate(x)) * up(x): ACTIVATION_KINDS' kind, or an unknown name
    activation_limit: float | None = None  # GatedMLP.activation_limit


# --- the whole checkpoint --------------------------------------------------------------------------------


@dataclass(frozen=True)
class FileInfo:
    name: str  # relative to the checkpoint folder
    size: int
    num_tensors: int


@dataclass(frozen=True)
class CheckpointModel:
    """Everything in a checkpoint, by structure. `head` is the lm_head: an EXL3 LinearInfo, an unquantized
    TensorInfo (head_bits 16), or None."""

    config: ModelConfig
    files: tuple[FileInfo, ...]
    layers: tuple[Layer, ...]
    head: LinearInfo | TensorInfo | None
    other_linears: tuple[LinearInfo, ...] = ()  # EXL3 linears outside the decoder layers and the head
    unquantized: tuple[TensorInfo, ...] = ()
    linears: Mapping[str, LinearInfo] = field(default_factory=dict, hash=False, compare=False, repr=False)
    blocks: Mapping[str, Block] = field(default_factory=dict, hash=False, compare=False, repr=False)

    @staticmethod
    def build(config, files, layers, head, other_linears=(), unquantized=()) -> "CheckpointModel":
        """A model with its `linears` and `blocks` lookups derived from the parts."""
        linears: dict[str, LinearInfo] = {}
        blocks: dict[str, Block] = {}
        for layer in layers:
            for lin in layer.linears:
                linears[lin.name] = lin
            for block in layer.blocks:
                blocks[block.name] = block
        if isinstance(head, LinearInfo):
            linears[head.name] = head
        for lin in other_linears:
            linears[lin.name] = lin
        return CheckpointModel(
            config, tuple(files), tuple(layers), head, tuple(other_linears), tuple(unquantized),
            MappingProxyType(linears), MappingProxyType(blocks),
        )
