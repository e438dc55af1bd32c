"""Kernel generators: `triton/` (flexfa's own Triton kernels for CUDA GPUs, the block-mask build
kernels included) and `cute/` (CuTe DSL hooks for FlashAttention-4's kernel templates, sm_90a and
sm_100a). docs/architecture.md places them in the pipeline."""
