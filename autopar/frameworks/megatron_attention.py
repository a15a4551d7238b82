"""Megatron-LM's ``--attention-backend``: the attention kernel a run uses, for pricing
(:func:`autopar.frameworks.megatron.read_megatron_args`)."""

from __future__ import annotations

__all__ = ["ATTENTION_BACKENDS", "attention_kernel"]

ATTENTION_BACKENDS = {"flash": "flash", "fused": "flash", "auto": "flash", "unfused": "math",
                      "local": "math"}
"""Megatron-LM's ``--attention-backend`` (megatron-core ``AttnBackend``,
``transformer/enums.py`` at core_v0.16.1; default ``auto``) -> the kernel priced:
Transformer Engine's FlashAttention and cuDNN fused attention keep output and log-sum-exp
("flash"; ``auto`` picks one of them for 16-bit inputs); its ``UnfusedDotProductAttention``
and megatron-core's ``local`` ``DotProductAttention`` keep the softmax ("math").
``LanguageModule._set_attention_backend`` turns the choice into TE's ``NVTE_FLASH_ATTN``,
``NVTE_FUSED_ATTN`` and ``NVTE_UNFUSED_ATTN``."""


def attention_kernel(backend: str, dtype: str) -> str:
    """The kernel ``--attention-backend backend`` runs in ``dtype`` (:data:`ATTENTION_
    BACKENDS`); fp32 runs unfused under ``auto``. Raises ValueError for an unknown backend
    or a fused one in fp32 (TE's flash and cuDNN kernels take fp16/bf16 inputs only:
    ``get_attention_backend`` disables both for other dtypes)."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend {backend}: Megatron-LM knows "
                         f"{', '.join(ATTENTION_BACKENDS)}")
    if dtype == "fp32":
        if backend in ("flash", "fused"):
            raise ValueError(f"--attention-backend {backend} without --bf16 or --fp16: "
                             "Transformer Engine's fused kernels take 16-bit inputs only; "
                             "use --attention-backend unfused or train in bf16")
        return "math"
    return ATTENTION_BACKENDS[backend]
