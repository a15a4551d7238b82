"""The precision a run trains in, as bytes: model states per parameter and the bytes of
each element its data-parallel collectives move (:class:`StateBytes`), by training dtype,
gradient dtype (:data:`autopar.contract.plan.GRAD_DTYPES`) and ZeRO stage. Each target runs one of
these (:mod:`autopar.targets`), and the cost model prices the one it runs."""

from __future__ import annotations

from dataclasses import dataclass

from autopar.contract.plan import grad_dtype_of
from autopar.techniques.zero_stages import zero_stage as zero_stage_record

__all__ = ["StateBytes", "state_bytes", "bytes_per_param"]


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of one precision under Adam: ``param``, ``grad`` and ``optimizer``
    held per parameter (before ZeRO shards them), ``gather`` per element of a parameter
    all-gather and ``reduce`` per element of a gradient reduction."""

    param: int
    grad: int
    optimizer: int
    gather: int
    reduce: int


def state_bytes(dtype: str, grad_dtype: str | None = None, zero_stage: int = 0) -> StateBytes:
    """The :class:`StateBytes` of training in ``dtype`` with ``grad_dtype`` gradients
    (:data:`autopar.contract.plan.GRAD_DTYPES`; None: the dtype's own) at ``zero_stage``:

    * fp32: 4 + 4 + 8 (m, v), fp32 gathers and reductions;
    * bf16, bf16 gradients: 2 + 2 + 12 (fp32 master, m, v; ZeRO paper section 3.1), bf16
      gathers and reductions (the autopar runtime; Megatron-LM ``--grad-reduce-in-bf16``);
    * bf16, fp32 gradients: 2 + 4 + 12 and fp32 reductions (Megatron-LM's fp32
      ``main_grad`` buffer, ``megatron/core/distributed/param_and_grad_buffer.py``: "6 + 12/d"
      bytes with the distributed optimizer, Megatron-LM ``docs/.../dist_optimizer.md``; DDP
      under ``torch.autocast``: fp32 parameters and gradients plus the bf16 weight copies
      autocast casts for its matmuls); under ZeRO-3 (FSDP2 with
      ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``) 4 + 4 + 8: the
      fp32 sharded parameter is the master copy, all-gathered in bf16.
    """
    if dtype == "fp32":
        return StateBytes(4, 4, 8, 4, 4)
    if grad_dtype_of(dtype, grad_dtype) == "bf16":
        return StateBytes(2, 2, 12, 2, 2)
    if zero_stage_record(zero_stage).shards_parameters:  # FSDP2's fp32 shard is the master
        return StateBytes(4, 4, 8, 2, 4)
    return StateBytes(2, 4, 12, 2, 4)


def bytes_per_param(zero_stage: int, dp: int, dtype: str = "bf16",
                    grad_dtype: str | None = None) -> float:
    """Model-state bytes per parameter under Adam and ZeRO (Rajbhandari et al. 2020,
    Fig. 1): for bf16 16, 4 + 12/d, 2 + 14/d, 16/d for stages 0..3 (fp32 gradients:
    18, 6 + 12/d, 2 + 16/d, 16/d; :func:`state_bytes`)."""
    from cost_models.memory import model_state_bytes

    b = state_bytes(dtype, grad_dtype, zero_stage)
    return model_state_bytes(1.0, zero_stage, dp, param_bytes=b.param, grad_bytes=b.grad,
                             optimizer_bytes=b.optimizer)
