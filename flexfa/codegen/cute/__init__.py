"""CuTe DSL code generation: flexfa's IR as hooks of FlashAttention-4's kernel templates.

`emit` turns traced mods into CuTe DSL functions, `module` renders, caches and loads the generated
module, `plan` decides how a call's mask reaches FA4 (native causal / window, or mask_mod),
`sparse` turns a BlockMask into FA4's block-sparse lists, `launch` calls FA4's forward and
backward, `backend` runs a call through autograd (the "fa4" backend is flexfa/backends/fa4.py),
and `offline` compiles for sm_90a / sm_100a without a GPU. Nothing here imports cutlass or
flash_attn until a module is loaded or a kernel is launched.
"""
