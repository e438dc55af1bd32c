"""Integrations of flexfa with model libraries; each imports its library only when used.

- `flexfa.integrations.transformers`: `register()` makes `attn_implementation="flexfa"` run every
  attention layer of a Hugging Face transformers model on flexfa (docs/transformers.md).
"""
