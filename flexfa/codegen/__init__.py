"""Code generation: `triton/` (CUDA GPUs, any Triton-supported arch) and `cute_sm100/` (Blackwell)."""
