"""User mods (FlexAttention's score_mod / mask_mod) as typed expression trees: ir, text, trace, grad, emit.

Torch-free at import; `trace` imports torch only when it traces. docs/mods.md describes the design.
"""
