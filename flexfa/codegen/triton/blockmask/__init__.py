"""Block masks built by generated Triton kernels (Note [Block-mask kernels by registration] in
flexfa/blockmask/kernels.py): the whole BlockMask of a mask in one kernel (fused.py, its source from
fused_emit.py), the exact tier's tile evaluation (exact_triton.py) and the BlockMask of a packed
batch (packed_fused.py). Importing this package registers them with flexfa.blockmask; the modules
themselves are imported at first use."""

from __future__ import annotations

from flexfa.blockmask.kernels import register


class TritonMaskKernels:
    """flexfa.blockmask.kernels.MaskKernels with this folder's kernels."""

    def available(self):
        from flexfa.codegen.triton.blockmask import fused

        return fused.available()

    def build(self, mask, grid):
        from flexfa.codegen.triton.blockmask import fused

        return fused.build(mask, grid)

    def exact_available(self):
        from flexfa.codegen.triton.blockmask import exact_triton

        return exact_triton.available()

    def classify_tiles(self, mask, grid, tiles):
        from flexfa.codegen.triton.blockmask import exact_triton

        return exact_triton.classify_tiles(mask, grid, tiles)

    def build_packed(self, traced, inner, grid, pack, rel):
        from flexfa.codegen.triton.blockmask import packed_fused

        return packed_fused.build(traced, inner, grid, pack, rel)


register(TritonMaskKernels())
