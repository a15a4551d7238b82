r"""Per-GPU memory and FLOPs of a whole plan from closed forms, to check the planner's
predictions for big models (``benchmarks/plan_large.py``, ``tests/slow/test_plan_closed_forms.py``).

A plan fixes t, p, d, b, m, the schedule and v, the ZeRO stage, the layers of each pipeline
rank and a recompute mode per layer. With Megatron's tensor-parallel pattern
(:func:`~autopar.planner.strategies.megatron.megatron_placements`), bf16 mixed
precision and math attention, the closed forms are:

**Model states** of pipeline rank i (Rajbhandari et al. 2020, Fig. 1): its parameters per
GPU :math:`\Psi_i` times 2 (bf16 weights), 2 (gradients), 12 (fp32 master, m, v) bytes,
the optimizer states divided by d from ZeRO-1, the gradients from ZeRO-2, the weights at
ZeRO-3. :math:`\Psi_i` sums the rank's layers and, on the first rank, the embeddings, on
the last the final norm and LM head (a tied head is one tensor when p = 1):

* GPT (autopar's, biased Linears): a layer :math:`(12h^2 + 7h)/t + 6h` (QKV and the MLP's
  first Linear column-split with their biases, the two row-split Linears keep whole biases,
  two LayerNorms whole); token embedding :math:`Vh/t`, positions :math:`s_{max} h` (whole);
  ``ln_f`` 2h and the tied head :math:`Vh/t`;
* Llama (no biases): a layer :math:`(2h^2 + 2h^2 kv/a + 3hf)/t + 2h`; embedding
  :math:`Vh/t`; final norm h, head :math:`Vh/t`.

**Activations** of rank i: (its layers' bytes per micro-batch + the embedding section's on
rank 0) times the micro-batches in flight (Narayanan et al. 2021 for 1F1B and interleaved,
the schedule record's ``in_flight``), plus, once, the head and loss on the last
rank and the working layer being run (a layer's whole activations, rebuilt by recompute).
Per layer: Korthikanti et al. 2022 Table 2 for GPT (:func:`autopar.oracle.symbolic.closed_form`,
dropout masks included), :mod:`autopar.oracle.symbolic_llama` for Llama, by recompute mode.
A layer pays for its input (kept by its first LayerNorm) and not for its output, which
the next layer or the head keeps. The sections outside the layers, by the same accounting:

* GPT embedding section: the embedding dropout's mask, sbh (its output is layer 0's
  input); head: the last layer's output and ``ln_f``'s output, kept by ``ln_f`` and the
  head, 2·2sbh, and the fp32 softmax of the vocabulary-parallel cross-entropy
  :math:`4sbV/t`;
* Llama embedding section: nothing per sequence (the embedding output is kept by nobody:
  RMSNorm keeps its fp32 copy, in layer 0); the causal mask kept by SDPA, the float
  positions (kept by their product with the inverse frequencies, a buffer: model state,
  not an activation), the rotary angles (kept by cos and sin) and cos and sin (kept by the
  attention-scaling products): :math:`2(s^2 + s + 3sh/a)` (not per sequence); head: the
  final RMSNorm :math:`2(2sbh + 2sb)` (its weight is a parameter), its output kept by the
  head 2sbh and the cross-entropy :math:`4sbV/t`.

**FLOPs** of one step (Narayanan et al. 2021, eq. 3 and section 5.1): model FLOPs
:math:`3B(L F + 2shV)` with F a layer's forward matmul FLOPs per sequence (GPT
:math:`24sh^2 + 4s^2h`; Llama :func:`~autopar.oracle.symbolic_llama.llama_closed_form`
"layer_flops"), the head's 2shV; hardware FLOPs add one forward of every fully recomputed
layer and the attention core :math:`4s^2h` of every selectively recomputed one.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy


from autopar.models import GPT
from autopar.oracle.symbolic import SYMBOLS, closed_form
from autopar.oracle.symbolic_llama import llama_closed_form
from autopar.contract.plan import Plan, rank_layers
from autopar.techniques.pipeline_schedules import pipeline_schedule
from autopar.techniques.recompute_modes import recompute_mode

__all__ = ["ModelShape", "layer_activation_bytes", "stage_memory_bytes", "step_flops",
           "predicted_flops"]

# what a recompute mode recomputes -> the closed form of the bytes a layer keeps
_ACTIVATIONS = {"nothing": "activations_tp", "attention_core": "activations_tp_selective",
                "layer": "activations_full"}
_STATE_BYTES = {"parameters": 2, "gradients": 2, "optimizer_states": 12}  # bf16 + Adam
_SHARDED_FROM = {"parameters": 3, "gradients": 2, "optimizer_states": 1}  # ZeRO stage


@dataclass(frozen=True)
class ModelShape:
    """The sizes the closed forms read. family: "gpt" (autopar's GPT, dropout > 0) or
    "llama" (transformers' LlamaForCausalLM, no biases); layers L, hidden h, heads a,
    kv_heads kv (= a for GPT), ffn f (4h for GPT), vocab V, positions (GPT's learned
    position rows, 0 for Llama), tied (head shares the token embedding)."""

    family: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    positions: int
    tied: bool

    @classmethod
    def of(cls, model) -> "ModelShape":
        """The shape of an autopar GPT or a Hugging Face Llama. ValueError otherwise."""
        if isinstance(model, GPT):
            c = model.config
            if c.dropout <= 0:
                raise ValueError("the GPT closed forms count dropout masks: build with dropout > 0")
            return cls("gpt", c.n_layer, c.n_embd, c.n_head, c.n_head, 4 * c.n_embd,
                       c.vocab_size, c.block_size, True)
        c = getattr(model, "config", None)
        if getattr(c, "model_type", None) != "llama" or c.attention_bias or c.mlp_bias:
            raise ValueError(f"no closed forms for {type(model).__name__}: expected autopar's "
                             "GPT or a bias-free transformers LlamaForCausalLM")
        return cls("llama", c.num_hidden_layers, c.hidden_size, c.num_attention_heads,
                   c.num_key_value_heads, c.intermediate_size, c.vocab_size, 0,
                   bool(c.tie_word_embeddings))

    def _values(self, s: int, b: int = 1, t: int = 1) -> dict:
        keys = dict(b=b, s=s, h=self.hidden, a=self.heads, kv=self.kv_heads, f=self.ffn, t=t,
                    V=self.vocab, L=self.layers)
        return {SYMBOLS[k]: v for k, v in keys.items()}

    def layer_params(self, t: int) -> float:
        """Parameters of one layer per GPU under TP size t."""
        h, a, kv, f = self.hidden, self.heads, self.kv_heads, self.ffn
        if self.family == "gpt":
            return (12 * h * h + 7 * h) / t + 6 * h
        return (2 * h * h + 2 * h * h * kv / a + 3 * h * f) / t + 2 * h

    def layer_flops(self, s: int) -> float:
        """Forward matmul FLOPs of one layer per sequence of s tokens."""
        if self.family == "gpt":
            return 24 * s * self.hidden ** 2 + 4 * s * s * self.hidden
        return float(llama_closed_form("layer_flops").subs(self._values(s)))


def layer_activation_bytes(shape: ModelShape, s: int, b: int, t: int, mode: str) -> float:
    """One layer's activation bytes per micro-batch per GPU (the module docstring)."""
    form = _ACTIVATIONS[recompute_mode(mode).recomputes]
    expr = closed_form(form) if shape.family == "gpt" else llama_closed_form(form)
    return float(expr.subs(shape._values(s, b, t)))


def _section_bytes(shape: ModelShape, s: int, b: int, t: int) -> tuple[float, float, float]:
    """(embedding section, head section without the loss, the loss's saved fp32 softmax)
    activation bytes per micro-batch per GPU."""
    h, a, V = shape.hidden, shape.heads, shape.vocab
    loss = 4 * s * b * V / t
    if shape.family == "gpt":
        return s * b * h, 4 * s * b * h, loss
    pre = 2 * (s * s + s + sympy.Rational(3 * s * h, a))
    return float(pre), 2 * (2 * s * b * h + 2 * s * b) + 2 * s * b * h, loss


def _stage_params(shape: ModelShape, plan: Plan, rank: int) -> float:
    h, V, t, p = shape.hidden, shape.vocab, plan.tp, plan.pp
    layers = rank_layers(plan.stage_layers, p, rank, schedule=plan.schedule)
    head = pipeline_schedule(plan.schedule).head_rank(p, plan.virtual_stages)
    params = len(layers) * shape.layer_params(t)
    if rank == 0:
        params += V * h / t + shape.positions * h
    if rank == head:
        params += (2 * h if shape.family == "gpt" else h) + V * h / t
        if shape.tied and head == 0:
            params -= V * h / t
    return params


def stage_memory_bytes(shape: ModelShape, plan: Plan) -> list[dict[str, float]]:
    """Per pipeline rank, bytes per GPU by kind (parameters, gradients, optimizer_states,
    activations), the keys of ``Prediction.memory_bytes_by_stage``."""
    s, b, t, p, d = plan.seq_len, plan.micro_batch_size, plan.tp, plan.pp, plan.dp
    pre, post, loss = _section_bytes(shape, s, b, t)
    per_mode = {m: layer_activation_bytes(shape, s, b, t, m) for m in ("none", "selective", "full")}
    out = []
    for rank in range(p):
        layers = rank_layers(plan.stage_layers, p, rank, schedule=plan.schedule)
        params = _stage_params(shape, plan, rank)
        mem = {kind: params * nbytes / (d if plan.zero_stage >= _SHARDED_FROM[kind] else 1)
               for kind, nbytes in _STATE_BYTES.items()}
        kept = sum(per_mode[plan.recompute[l]] for l in layers) + (pre if rank == 0 else 0.0)
        inflight = pipeline_schedule(plan.schedule).in_flight(p, rank, plan.num_micro_batches,
                                                              plan.virtual_stages)
        working = per_mode["none"] if layers else 0.0
        head = pipeline_schedule(plan.schedule).head_rank(p, plan.virtual_stages)
        record, args = pipeline_schedule(plan.schedule), (p, plan.num_micro_batches,
                                                          plan.virtual_stages)
        held = (post * record.head_weight_inputs_in_flight(*args)
                + loss * record.head_in_flight(*args))  # inputs to W, the loss's to B
        mem["activations"] = kept * inflight + (held if rank == head else 0.0) + working
        out.append(mem)
    return out


def step_flops(shape: ModelShape, plan: Plan) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one step of ``plan`` (the module docstring)."""
    s, B = plan.seq_len, plan.global_batch_size
    layer = shape.layer_flops(s)
    model = 3.0 * B * (shape.layers * layer + 2 * s * shape.hidden * shape.vocab)
    core = 4.0 * s * s * shape.hidden
    extra = sum(recompute_mode(r).recomputed(layer, core) for r in plan.recompute)
    return model, model + B * extra


def predicted_flops(plan: Plan, peak_flops: float) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one step as ``plan.predicted`` reports them: MFU
    and TFLOP/s per GPU times step time, GPUs and (for MFU) the device's peak FLOP/s."""
    pred = plan.predicted
    model = pred.mfu * pred.step_time_s * plan.num_gpus * peak_flops
    hardware = pred.tflops_per_gpu * 1e12 * pred.step_time_s * plan.num_gpus
    return model, hardware
