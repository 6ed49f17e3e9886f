"""ExLlamaV3 (the format's owner) as a peer: its EXL3 linear and its MoE block, run the way its forward runs them.

Imported only when ``--peer exllamav3`` is asked for: the first ``import exllamav3.ext`` builds its CUDA
extension (minutes). Its output goes through the same reference check as ours before it is timed.
"""

from __future__ import annotations

import functools
import importlib
import os
import shutil
import sys
from pathlib import Path

import torch

from exl3tool.errors import UsageError
from exl3tool.format import MCG_MARKER, MUL1_MARKER, Codebook, LinearTensors

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
PEER_DIR_ENV = "EXL3TOOL_PEER_DIR"  # a folder with tokenizer.json/tokenizer_config.json (ExLlamaV3 loads them)


@functools.cache
def _exllamav3_ext_error() -> Exception | None:
    """This process's one ``import exllamav3.ext``: None, or the error it raised (any build or load failure)."""
    try:
        importlib.import_module("exllamav3.ext")
    except Exception as error:  # each case reports it as its peer row's note
        return error
    return None


def require_exllamav3_ext() -> None:
    """Import ExLlamaV3's CUDA extension once a process: its first import builds it (minutes), and a build that
    fails would otherwise be tried again, minutes each, by every case that asks for the peer. Raises the first
    attempt's error each time after it."""
    error = _exllamav3_ext_error()
    if error is not None:
        raise error


def exllamav3_linear(t: LinearTensors):
    """``call(x) -> y`` with ExLlamaV3's ``LinearEXL3`` on the tensors of ``t`` (on the GPU).

    Conventions: a checkpoint's suh/svh/trellis are ExLlamaV3's own tensors, passed as its loader passes them
    (legacy su/sv are already expanded to +-1 suh/svh, which its ``unpack_bf`` would also produce). Like its
    loader, it gets the padded sizes (``modules/linear.py`` pads in/out to 128), so x is zero-padded to in_p
    once here and its output is trimmed to out_features (a view)."""
    require_exllamav3_ext()
    from exllamav3.modules.quant.exl3 import AUTO_RECONSTRUCT_THRESHOLD, LinearEXL3

    info, device = t.info, t.trellis.device
    marker = lambda value: torch.tensor(value, dtype=torch.int32, device=device)  # noqa: E731
    lin = LinearEXL3(
        None, info.in_padded, info.out_padded, suh=t.suh, svh=t.svh, trellis=t.trellis.to(torch.int16),
        mcg=marker(MCG_MARKER) if info.codebook is Codebook.MCG else None,
        mul1=marker(MUL1_MARKER) if info.codebook is Codebook.MUL1 else None,
        bias=t.bias,
    )

    def prepare(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float16:
            raise UsageError("ExLlamaV3's linear takes float16 activations")
        return torch.nn.functional.pad(x, (0, info.in_padded - info.in_features)).contiguous()

    def call(xp: torch.Tensor) -> torch.Tensor:
        # what LinearEXL3.forward picks at this M (without its params dict)
        if xp.shape[0] <= AUTO_RECONSTRUCT_THRESHOLD:
            y = lin.bc.run_alloc(xp, info.out_padded, False)
        else:
            y = lin.reconstruct_hgemm(xp, None)
        return y[:, : info.out_features]

    return prepare, call


def peer_dir() -> Path:
    """Where ExLlamaV3's tokenizer files are: ``$EXL3TOOL_PEER_DIR``, else the folder whose ``stub/`` the
    project's ``build.sh`` put on the Python path."""
    candidates = [os.environ.get(PEER_DIR_ENV)] + [str(Path(p).parent) for p in sys.path if Path(p).name == "stub"]
    for c in candidates:
        if c and all((Path(c) / f).is_file() for f in TOKENIZER_FILES):
            return Path(c)
    raise UsageError(f"ExLlamaV3's MoE peer loads a model folder and needs {' and '.join(TOKENIZER_FILES)}: set "
                     f"{PEER_DIR_ENV} to a folder that has them")


def exllamav3_moe(folder: Path, layer: int, device: torch.device):
    """``call(x) -> y`` with ExLlamaV3's ``BlockSparseMLP`` of ``layer``, loaded from a synthetic Qwen3-MoE
    ``folder`` (written by exl3tool.synthetic; ExLlamaV3 also wants q_norm/k_norm weights and tokenizer files,
    which the caller adds: `prepare_moe_folder`)."""
    require_exllamav3_ext()
    from exllamav3 import Config, Model

    model = Model.from_config(Config.from_directory(str(folder)))
    model.load(str(device))
    key = f"model.layers.{layer}.mlp"
    mlp = next(m for m in model if getattr(m, "key", "") == key)
    hidden = mlp.hidden_size

    def call(x: torch.Tensor) -> torch.Tensor:
        return mlp.forward(x.view(1, x.shape[0], hidden), {}).view(x.shape[0], hidden)

    return model, call


def prepare_moe_folder(folder: Path, layers: int, head_dim: int) -> None:
    """What ExLlamaV3 needs besides our synthetic checkpoint: Qwen3's q_norm/k_norm weights and a tokenizer."""
    from exl3tool.synthetic import edit_checkpoint

    edit_checkpoint(folder, add={f"model.layers.{i}.self_attn.{n}.weight": torch.ones(head_dim, dtype=torch.float16)
                                 for i in range(layers) for n in ("q_norm", "k_norm")})
    source = peer_dir()
    for f in TOKENIZER_FILES:
        shutil.copyfile(source / f, folder / f)
