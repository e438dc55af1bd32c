"""CuTe DSL code generation: flexfa's IR as hooks of FlashAttention-4's kernel templates.

`emit` turns traced mods into CuTe DSL functions, `module` renders, caches and loads the generated
module, `plan` decides how a call's mask reaches FA4 (native causal / window, or mask_mod), `launch`
calls FA4's forward and backward, and `backend` is the "fa4" backend. Nothing here imports cutlass
or flash_attn until a module is loaded or a kernel is launched.
"""
