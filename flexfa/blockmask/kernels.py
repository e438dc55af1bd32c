"""Block-mask builders that run as generated GPU kernels, registered by their kernel generator.

# Note [Block-mask kernels by registration]
# This folder, the plan, is data and CPU code: it decides tiles by analysis and evaluates the rest
# with torch. On a GPU three steps run faster as generated kernels: the whole BlockMask of a mask
# in one kernel (Note [Fused analysis]), the exact tier's tile evaluation, and the BlockMask of a
# packed batch (Note [Packed block masks in one kernel]). Those kernels are generated code, so they
# live with their generator (flexfa/codegen/triton/blockmask/), a layer above this one, which this
# folder must not import (docs/architecture.md: layers point down). So the generator registers its
# builders here when it is imported, and `create_block_mask` asks for them at each build.
# flexfa/__init__.py imports the Triton generator's builders, and importing any part of flexfa
# runs it first, so every process has them; with none registered (only possible by editing that
# import away) every mask is built by the torch code of this folder, as on the CPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from flexfa.blockmask.block_mask import BlockMask
    from flexfa.blockmask.grid import TileGrid, TileList
    from flexfa.blockmask.packed import Packing
    from flexfa.frontend.trace import TracedMod


class MaskKernels(Protocol):
    """What a kernel generator offers the plan; each builder may return None ("build it the
    general way"), and says why in the log."""

    def available(self) -> bool:
        """Whether the kernels can run in this process (their compiler imports)."""

    def build(self, mask: TracedMod, grid: TileGrid) -> BlockMask | None:
        """The BlockMask of `mask` on `grid` from one kernel (Note [Fused analysis])."""

    def exact_available(self) -> bool:
        """Whether the exact tier's kernel can run in this process."""

    def classify_tiles(self, mask: TracedMod, grid: TileGrid, tiles: TileList) -> torch.Tensor:
        """Tile states int8 [T] of the listed tiles (`flexfa.blockmask.exact.classify_tiles`)."""

    def build_packed(
        self,
        traced: TracedMod,
        inner: TracedMod | None,
        grid: TileGrid,
        pack: Packing,
        rel: TileGrid,
    ) -> BlockMask | None:
        """The BlockMask of a packed batch from one kernel (Note [Packed block masks in one
        kernel])."""


_registered: MaskKernels | None = None


def register(kernels: MaskKernels) -> None:
    """Make `kernels` the GPU block-mask builders (the last registration wins)."""
    global _registered
    _registered = kernels


def registered() -> MaskKernels | None:
    """The registered GPU block-mask builders, or None."""
    return _registered
