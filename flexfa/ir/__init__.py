"""flexfa's intermediate representation of traced mods.

- `nodes`: the interned, immutable `Node` and its `Op`s; `dtypes`: scalar types and promotion.
- `build`: typed constructors; `verify`: the invariants; `printer`: readable text.
- `evaluate`: execution over torch tensors; `simplify`: rewrite rules and constant folding;
  `autodiff`: reverse-mode derivatives of score_mods.
"""

from flexfa.ir.autodiff import LoadGradient, ScoreModGradient, score_mod_gradient
from flexfa.ir.dtypes import DType
from flexfa.ir.evaluate import Evaluator, evaluate
from flexfa.ir.nodes import MASK_MOD_PARAMS, SCORE_MOD_PARAMS, Capture, Node, Op, Scalar
from flexfa.ir.printer import format_expr, format_graph
from flexfa.ir.simplify import simplify
from flexfa.ir.verify import IRVerificationError, verify

__all__ = [
    "MASK_MOD_PARAMS",
    "SCORE_MOD_PARAMS",
    "Capture",
    "DType",
    "Evaluator",
    "IRVerificationError",
    "LoadGradient",
    "Node",
    "Op",
    "Scalar",
    "ScoreModGradient",
    "evaluate",
    "format_expr",
    "format_graph",
    "score_mod_gradient",
    "simplify",
    "verify",
]
