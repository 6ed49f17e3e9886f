"""exl3tool's GPU kernels, written in the CuTe DSL (installed as ``exl3tool.kernels``).

One source for every GPU with warp-level ``mma.sync.m16n8k16`` (SM80, SM89, SM90, SM120); shared memory per
CTA stays within SM120's 99 KB.

    trellis   the lane-level trellis decode (one algorithm; ``ptx`` runs it on the GPU, ``emulate`` on the CPU)
    gemm      dense W4A16 GEMM with in-register decode, split over K
    rotate    input rotation (x * suh, H128) and output rotation (split reduction, H128, * svh, + bias)
    dequant   trellis -> fp16 W_hat
"""
