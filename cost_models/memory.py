"""Memory per GPU: model states (ZeRO), activations (Korthikanti), pipeline in-flight.

All results are in bytes.  Symbols follow DESIGN.md: s sequence length, b
micro-batch size, h hidden size, a attention heads, t tensor-parallel size,
p pipeline stages, m micro-batches per step, v virtual stages per rank, d
data-parallel size, Psi parameter count.
"""

from __future__ import annotations

from ._checks import (RECOMPUTE_MODES, check_choice, check_non_negative, check_positive,
                      check_positive_int)

ADAM_OPTIMIZER_BYTES_PER_PARAM = 12
"""K in ZeRO (Rajbhandari et al. 2020, section 3.1): mixed-precision Adam keeps an
fp32 master copy, momentum and variance, 4 + 4 + 4 bytes per parameter."""


def model_state_bytes(
    num_params: float,
    zero_stage: int,
    dp: int,
    param_bytes: float = 2,
    grad_bytes: float = 2,
    optimizer_bytes: float = ADAM_OPTIMIZER_BYTES_PER_PARAM,
) -> float:
    """Bytes of parameters + gradients + optimizer states held by one GPU.

    ZeRO (Rajbhandari et al. 2020, section 5 and Figure 1), with Psi = num_params,
    P/G/K = param/grad/optimizer bytes per parameter and d = dp:

        stage 0 (plain DP):                 (P + G + K) * Psi
        stage 1 (optimizer states sharded):  P*Psi + G*Psi + K*Psi/d
        stage 2 (+ gradients sharded):       P*Psi + (G + K)*Psi/d
        stage 3 (+ parameters sharded):      (P + G + K)*Psi/d

    ``num_params`` is the count this GPU's model replica holds (already divided by
    t and p where those apply).  With Psi = 7.5e9, d = 64, K = 12 this gives the
    paper's 120 GB, 31.4 GB, 16.6 GB and 1.9 GB.
    """
    psi = check_non_negative("num_params", num_params)
    if zero_stage not in (0, 1, 2, 3) or isinstance(zero_stage, bool):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    d = check_positive_int("dp", dp)
    p = check_non_negative("param_bytes", param_bytes)
    g = check_non_negative("grad_bytes", grad_bytes)
    k = check_non_negative("optimizer_bytes", optimizer_bytes)
    replicated = (p + g + k, p + g, p, 0.0)[zero_stage]
    sharded = (p + g + k) - replicated
    return psi * (replicated + sharded / d)


def transformer_layer_activation_bytes(
    seq_len: float,
    micro_batch_size: float,
    hidden_size: float,
    num_heads: float,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
) -> float:
    """Activation bytes one transformer layer keeps for backward, per micro-batch, per GPU.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
    Models"), section 4 and Table 2, 16-bit activations, 1-byte dropout masks:

        no parallelism             s*b*h * (34 + 5*a*s/h)
        tensor parallel (t)        s*b*h * (10 + 24/t + 5*a*s/(h*t))
        tensor + sequence parallel s*b*h * (34/t + 5*a*s/(h*t))
        selective recompute        the same without the attention-core term 5*a*s/(h*t)
        full recompute             2*s*b*h (the layer input only; divided by t with SP)

    The 10 in the TP-only row is the LayerNorm/dropout/residual part that stays
    replicated; sequence parallelism splits it too.  With t = 1 all rows agree.
    """
    s = check_positive("seq_len", seq_len)
    b = check_positive("micro_batch_size", micro_batch_size)
    h = check_positive("hidden_size", hidden_size)
    a = check_positive("num_heads", num_heads)
    t = check_positive_int("tp", tp)
    if not isinstance(sequence_parallel, bool):
        raise ValueError(f"sequence_parallel must be a bool, got {sequence_parallel!r}")
    check_choice("recompute", recompute, RECOMPUTE_MODES)
    sbh = s * b * h
    linear_part = 34 / t if sequence_parallel else 10 + 24 / t
    attention_core = 5 * a * s / (h * t)
    table_2 = {"none": sbh * (linear_part + attention_core), "selective": sbh * linear_part,
               "full": 2 * sbh / (t if sequence_parallel else 1)}  # the rows above
    return table_2[recompute]


def _stage_args(pp: int, stage: int, num_micro_batches: int) -> tuple[int, int, int]:
    p = check_positive_int("pp", pp)
    if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage < p:
        raise ValueError(f"stage must be an int in [0, pp={p}), got {stage!r}")
    return p, stage, check_positive_int("num_micro_batches", num_micro_batches)


def all_forwards_in_flight(pp: int, stage: int, num_micro_batches: int) -> float:
    """Micro-batches' worth of whole-stage activations a stage holds at peak when all m
    forwards run before any backward (GPipe, Huang et al. 2019): m on every stage.

    Multiply by the activation bytes of one micro-batch through all of the stage's layers
    to get the stage's peak activation memory. ValueError for ``stage`` outside [0, pp)."""
    return float(_stage_args(pp, stage, num_micro_batches)[2])


def one_forward_one_backward_in_flight(pp: int, stage: int, num_micro_batches: int) -> float:
    """The same for 1F1B (PipeDream-flush, Narayanan et al. 2021 section 2.2.1): stage i
    runs p - i - 1 warm-up forwards, then one more before its first backward, so it holds
    ``min(p - i, m)``. ValueError for ``stage`` outside [0, pp)."""
    p, i, m = _stage_args(pp, stage, num_micro_batches)
    return float(min(p - i, m))


def interleaved_in_flight(pp: int, stage: int, num_micro_batches: int,
                          virtual_stages: int) -> float:
    """The same for interleaved 1F1B, in whole-stage micro-batches: each rank holds v chunks
    of L/(p*v) layers. Megatron-LM's ``forward_backward_pipelining_with_interleaving`` runs
    ``2*(p - i - 1) + (v - 1)*p`` warm-up chunk-forwards on rank i, plus one before the
    first backward, capped at the m*v chunk-forwards of the step. A chunk is 1/v of the
    stage, so the peak is ``min(2*(p-i-1) + (v-1)*p + 1, m*v) / v``. For stage 0 that is
    ``p + (p-1)/v = p * (1 + (p-1)/(p*v))``, the factor of Narayanan et al. 2021 /
    Korthikanti et al. 2022 (section 4.2.3); it decreases by 2/v per later stage.
    ValueError for ``stage`` outside [0, pp) or v < 1."""
    p, i, m = _stage_args(pp, stage, num_micro_batches)
    v = check_positive_int("virtual_stages", virtual_stages)
    return min(2 * (p - i - 1) + (v - 1) * p + 1, m * v) / v
