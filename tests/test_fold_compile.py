"""The fold kernel (kernels/fold.py) compiles for SM120 and SM90 on the CPU: both H128 passes are there, no spills,
and its CTA fits SM120's 99 KB of shared memory."""

import pytest

from exl3tool import sass
from exl3tool.kernels.fold import SMEM_BYTES, FoldConfig
from exl3tool.ops.fold import fold_builder
from exl3tool.ops.runtime import compile_with_ptx

pytestmark = pytest.mark.compile


@pytest.mark.parametrize("arch", ["sm_120a", "sm_90a"])
@pytest.mark.parametrize("cfg", [FoldConfig(4.0, "mcg"), FoldConfig(2.0, "3inst", "bfloat16"),
                                 FoldConfig(3.5, "mul1"), FoldConfig(6.0, "mcg", "bfloat16")], ids=str)
def test_fold_compiles(cfg, arch):
    ptx = compile_with_ptx(lambda options: fold_builder(cfg, options), arch)
    # 16 rows and 16 columns per warp, five butterfly exchanges on four registers each.
    assert ptx.count("shfl.sync.bfly") == 2 * 16 * 5 * 4
    assert SMEM_BYTES <= 99 * 1024


def test_fold_sm120_resources():
    cfg = FoldConfig(4.0, "mcg")
    (k,) = sass.analyze_cubin(sass.compile_cubin(lambda options: fold_builder(cfg, options), "sm_120a"),
                              dynamic_smem_bytes=SMEM_BYTES)
    assert k.spill_instructions == 0 and k.frame_bytes == 0 and k.registers <= 64
    assert k.smem_per_cta_bytes <= 99 * 1024
