"""flexfa's Triton kernels: IR -> device functions (`emit`), kernel templates (`templates/`),
module rendering and caching (`module`), configs (`configs`, `decode_configs`), the plans and
launches of a call (`backend`, `decode`), and the block-mask build kernels (`blockmask/`). The
"triton" backend that runs them is flexfa/backends/triton.py."""
