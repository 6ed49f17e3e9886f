"""Host side of the GPU kernels: compile cache, launches, and the EXL3 linear built from them.

Only this package and ``exl3tool.kernels`` import the CuTe DSL; import it lazily from elsewhere so the CPU-only
commands (inspect, prepare) never pay for it.
"""
