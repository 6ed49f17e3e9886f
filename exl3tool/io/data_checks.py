"""Checks that need tensor data: the suh/svh vectors (small, fp16) of every EXL3 linear.

- NaN or Inf in suh/svh: every output of the linear would be NaN/Inf.
- svh nonzero on padded output columns: EXL3 zeroes them; nonzero padding means the true size is not what
  config.json says (or the file is corrupt).
"""

from __future__ import annotations

import numpy as np

from exl3tool.errors import Problem
from exl3tool.format import LinearInfo


def check_scales(info: LinearInfo, read) -> list[Problem]:
    """Problems of one linear's suh/svh; `read(tensor_name) -> bytes`. Legacy su/sv (signs) cannot be NaN."""
    problems = []
    for leaf in ("suh", "svh"):
        tensor = info.tensors.get(leaf)
        if tensor is None or tensor.dtype != "F16" or len(tensor.shape) != 1:
            continue  # absent (legacy signs) or malformed: the header checks already reported it
        values = np.frombuffer(read(tensor.name), dtype="<f2")
        bad = ~np.isfinite(values)
        if bad.any():
            where = np.flatnonzero(bad)
            problems.append(Problem(
                "scale-nonfinite", f"{int(bad.sum())} NaN/Inf value(s) in {leaf}, first at index {int(where[0])}",
                tensor.file, tensor.name, module=info.name))
        if leaf == "svh" and info.dims_from_config and info.out_features < len(values):
            padding = values[info.out_features :]
            if np.any(np.isfinite(padding) & (padding != 0)):  # NaN/Inf are reported above
                problems.append(Problem(
                    "svh-padding", f"svh is nonzero on padded output columns {info.out_features}.."
                    f"{len(values) - 1}: EXL3 zeroes them, so the true output size is not {info.out_features}",
                    tensor.file, tensor.name, module=info.name))
    return problems
