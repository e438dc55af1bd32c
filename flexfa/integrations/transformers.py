"""flexfa as an attention implementation of Hugging Face transformers.

>>> import flexfa.integrations.transformers as flexfa_hf
>>> flexfa_hf.register()  # then: AutoModelForCausalLM.from_config(cfg, attn_implementation="flexfa")
'flexfa'

`register(name)` puts two functions under `name` in transformers' registries: `attention_forward`
(the `AttentionInterface`: one call per attention layer) and `build_mask` (the
`AttentionMaskInterface`: one call per kind of layer and forward, from `create_causal_mask`,
`create_sliding_window_causal_mask`, ...). The masks (`build_mask`, Note [Transformers' masks as
flexfa masks] and the others) are in flexfa/integrations/transformers_masks.py. These two modules
are the only ones of flexfa that import transformers (the `flexfa[transformers]` extra).
docs/transformers.md says what is honoured.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

import flexfa
from flexfa.integrations.transformers_masks import (
    SHORT_QUERY,
    MaskParts,
    PackedDocuments,
    TransformersMask,
    build_mask,
    stable_softcap,
)
from flexfa.mods import softcap as softcap_mod


def register(name: str = "flexfa") -> str:
    """Register flexfa's attention and mask functions with transformers under `name`.

    Afterwards `AutoModelForCausalLM.from_config(config, attn_implementation=name)` (or
    `from_pretrained(...)`, or `model.set_attn_implementation(name)`) runs every attention layer on
    flexfa. Returns `name`.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, build_mask)
    return name


# -- the attention -------------------------------------------------------------------------------


def _dense_mask_score_mod(mask: torch.Tensor, softcap: float | None) -> Callable[..., Any]:
    """A 4-D mask given by the caller (bool: True attends; float: added to the scores), after an
    optional softcap."""
    cap = softcap_mod(softcap) if softcap else None
    if mask.dtype == torch.bool:

        def dense_mask(score, b, h, q_idx, kv_idx):
            if cap is not None:
                score = cap(score, b, h, q_idx, kv_idx)
            return torch.where(mask[b, 0, q_idx, kv_idx], score, -float("inf"))

    else:

        def dense_mask(score, b, h, q_idx, kv_idx):
            if cap is not None:
                score = cap(score, b, h, q_idx, kv_idx)
            return score + mask[b, 0, q_idx, kv_idx]

    return dense_mask


_dense_warned = False


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: TransformersMask | torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: one attention layer on flexfa.

    query (B, Hq, Lq, E), key/value (B, Hkv, Lkv, E|Ev) as the model's attention module passes
    them (KV caches included); returns the output as (B, Lq, Hq, Ev) and no attention weights.
    `scaling`, GQA, `softcap` (Gemma 2), the mask of `build_mask` and `s_aux` (GPT-OSS's attention
    sinks, applied through the LSE) are honoured; `dropout` > 0 is refused, as transformers does
    for torch FlexAttention.
    """
    if dropout:
        raise ValueError(
            f"flexfa attention does not support attention dropout (got dropout={dropout}): run "
            "inference with model.eval(), or set the config's attention dropout to 0 to train"
        )
    score_mod = stable_softcap(float(softcap)) if softcap else None
    block_mask = None
    if isinstance(attention_mask, TransformersMask):
        mask_mod = attention_mask.mask_mod
        if not torch.compiler.is_compiling():
            block_mask = attention_mask.block_mask
            built_none = attention_mask.static_cache is None and attention_mask.packed is None
            if block_mask is None and mask_mod is not None and built_none:
                # Note [Short queries' padding as a score_mod]
                score_mod = mask_mod.as_score_mod(float(softcap) if softcap else None)
        elif mask_mod is not None and query.shape[2] <= SHORT_QUERY:
            score_mod = mask_mod.as_score_mod(float(softcap) if softcap else None)
        else:
            block_mask = mask_mod
    elif isinstance(attention_mask, torch.Tensor):
        global _dense_warned
        if not _dense_warned:
            _dense_warned = True
            warnings.warn(
                "flexfa was given a dense 4-D attention mask (built outside flexfa's mask "
                "builder): it is read per pair as a score_mod, without skipping masked tiles",
                stacklevel=2,
            )
        mask = attention_mask[:, :, :, : key.shape[-2]]
        score_mod = _dense_mask_score_mod(mask, float(softcap) if softcap else None)
    elif attention_mask is not None:
        raise TypeError(
            "flexfa attention expects the mask of flexfa's mask builder, a 4-D tensor or None, got "
            f"{type(attention_mask).__name__}; build the model with attn_implementation set to "
            "the name given to flexfa.integrations.transformers.register()"
        )
    enable_gqa = query.shape[1] != key.shape[1]
    layout = {}  # how flexfa reads the batch: as a packed row, or a static cache as pages
    packed = getattr(attention_mask, "packed", None)
    if packed is not None and not torch.compiler.is_compiling():
        cu = packed.cu_seqlens  # Note [Packed sequences as a packed call]
        if cu is not None and query.shape[0] == 1:
            layout = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu)
            block_mask = packed.mask_mod
        else:  # not documents after all: the document mask, built by flexfa for these shapes
            block_mask = attention_mask.mask_mod
    static = getattr(attention_mask, "static_cache", None)
    if (
        static is not None
        and not torch.compiler.is_compiling()
        and key.shape[0] == static.kv_lens.shape[0]
        and key.shape[2] == static.capacity
    ):  # Note [Static caches as page pools]
        layout = dict(page_table=static.page_table, kv_lens=static.kv_lens)
        block_mask = None
    elif static is not None and not torch.compiler.is_compiling():
        block_mask = attention_mask.mask_mod  # built for this call's keys
    call = dict(score_mod=score_mod, block_mask=block_mask, scale=scaling, enable_gqa=enable_gqa)
    if s_aux is None:
        out = flexfa.attention(query, key, value, **call, **layout)
    else:
        out, lse = flexfa.attention(query, key, value, **call, **layout, return_lse=True)
        out = _apply_sinks(out, lse, s_aux)
    # flexfa's output has q's memory layout, (B, Lq, Hq, E) in memory for transformers' q.
    return out.transpose(1, 2), None


def _apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention with one extra logit per head that has no value (GPT-OSS): the softmax's
    denominator gains exp(sink), so the output scales by exp(lse) / (exp(lse) + exp(sink)) =
    sigmoid(lse - sink); differentiable in out, lse and the sinks. An empty row stays 0."""
    factor = torch.sigmoid(lse - sinks.float().view(1, -1, 1))
    return (out.float() * factor.unsqueeze(-1)).to(out.dtype)


__all__ = [
    "MaskParts",
    "PackedDocuments",
    "TransformersMask",
    "attention_forward",
    "build_mask",
    "register",
]
