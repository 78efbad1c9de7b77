"""CPU emulation of the CUDA kernels for tests: build.py compiles, runtime.py launches (see cuda_emu.h)."""
