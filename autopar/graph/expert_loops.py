"""Static forms of expert loops whose shapes depend on the routing.

Most ``transformers`` MoE families run their experts through ``transformers``' experts
interface, whose ``grouped_mm`` form sorts the (token, expert) pairs by expert and runs one
grouped matmul over them (``transformers.integrations.moe.grouped_mm_experts_forward``):
every shape is fixed by the token count, so ``torch.export`` captures it. Two families run
their experts otherwise, and export cannot capture them:

* LongCat-Flash loops in Python over the experts the batch routes to
  (``for expert_idx in expert_mask.sum(...).nonzero()``: a loop of data-dependent length);
* JetMoE reads the per-expert token counts back to the host (``expert_size.tolist()``) and
  splits the tokens by them (tensors of data-dependent size), in its MoE MLP and its
  mixture of attention heads alike;
* DBRX loops over the experts hit (``nonzero``), its experts fused in 2-D parameters
  ``w1``, ``v1``, ``w2`` of (E·F, h);
* every family whose experts class carries transformers' ``@use_experts_implementation``
  runs such a loop too when its config asks for ``"eager"`` experts
  (``model.set_experts_implementation("eager")``): :func:`static_experts` switches the
  model to transformers' own ``"grouped_mm"`` form while it is captured, and back.

While autopar captures a model, each module whose class :data:`STATIC_FORWARDS` names runs
the same computation in the grouped form instead (:func:`static_experts`): the same
parameters, the same routing, the same sums, in a fixed-shape graph. The model itself is
untouched, so verify's single-device reference runs the family's own loop and checks the
captured program against it. Recognising expert loops of any model is the MoE issue's
capture; this table is what lets today's families be planned and verified.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["STATIC_FORWARDS", "static_experts"]


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor
                    ) -> torch.Tensor:
    """``x`` (S, in) rows sorted by expert, times expert ``e``'s ``weight[e]`` (E, out, in)
    transposed for the rows ``offs[e-1]:offs[e]`` (``offs`` int32 (E,), cumulative): (S, out).
    ``transformers``' own dispatcher (``torch.nn.functional.grouped_mm`` where its stride
    rules hold, else its ``transformers::grouped_mm_fallback`` op), so these families price
    and run like every other MoE family of ``transformers``."""
    from transformers.integrations.moe import _grouped_mm  # transformers' families only

    return _grouped_mm(x, weight.transpose(-2, -1), offs=offs)


def _jetmoe_gating(self: nn.Module, hidden_states: torch.Tensor):
    """``JetMoeTopKGating.forward`` with the per-expert token counts kept a tensor (E,)
    instead of read back with ``.tolist()``; every other output as the family computes it.
    ``hidden_states`` (T, h)."""
    logits = self.layer(hidden_states).float()
    top_k_logits, top_k_indices = logits.topk(self.top_k, dim=1)
    top_k_gates = torch.softmax(top_k_logits, dim=1).type_as(hidden_states)
    zeros = torch.zeros(top_k_gates.size(0), self.num_experts, dtype=top_k_gates.dtype,
                        device=top_k_gates.device)
    expert_size = zeros.scatter(1, top_k_indices, 1).long().sum(0)
    _, index_sorted_experts = top_k_indices.flatten().sort(0)
    batch_index = index_sorted_experts.div(self.top_k, rounding_mode="trunc")
    batch_gates = top_k_gates.flatten()[index_sorted_experts]
    return index_sorted_experts, batch_index, batch_gates, expert_size, logits


def _jetmoe_parallel_experts(self: nn.Module, inputs: torch.Tensor,
                             expert_size: torch.Tensor) -> torch.Tensor:
    """``JetMoeParallelExperts.forward``: ``inputs`` (S, in) sorted by expert, ``expert_size``
    (E,) the rows per expert (a tensor from :func:`_jetmoe_gating`), weight (E, out, in)."""
    offs = torch.cumsum(expert_size, dim=0, dtype=torch.int32)
    return _grouped_linear(inputs, self.weight, offs)


def _sort_by_expert(top_k_index: torch.Tensor, num_experts: int):
    """The (token, slot) pairs of ``top_k_index`` (T, k) sorted by expert, stably (ties keep
    token order): (expert of each pair (S,), the pairs' flat indices (S,), their tokens (S,),
    ``offs`` int32 (E,): cumulative rows per expert, for :func:`_grouped_linear`); S = T·k."""
    expert_sorted, perm = torch.sort(top_k_index.reshape(-1), stable=True)
    counts = F.one_hot(expert_sorted, num_experts).sum(0)
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    return expert_sorted, perm, perm // top_k_index.shape[-1], offs


def _longcat_experts(self: nn.Module, hidden_states: torch.Tensor,
                     top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """``LongcatFlashExperts.forward``: ``hidden_states`` (T, h), ``top_k_index`` and
    ``top_k_weights`` (T, k). Experts ``< num_routed_experts`` are gated MLPs
    (``gate_up_proj`` (E', 2I, h), ``down_proj`` (E, h, I)), the rest the identity
    ("zero-computation experts"); each pair's output is weighted and summed per token in
    expert order, as the family's loop adds them."""
    k, total = top_k_index.shape[-1], self.total_experts
    expert_sorted, perm, token, offs = _sort_by_expert(top_k_index, total)
    x = hidden_states[token]  # (S, h), sorted by expert
    routed = self.num_routed_experts
    if self.gate_up_proj is not None and routed > 0:
        gate_up = _grouped_linear(x, self.gate_up_proj, offs)
        gate, up = gate_up.chunk(2, dim=-1)
        down = torch.cat([self.down_proj, self.down_proj.new_zeros(
            total - routed, *self.down_proj.shape[1:])]) if total > routed else self.down_proj
        y = _grouped_linear(self.act_fn(gate) * up, down, offs)
        y = torch.where((expert_sorted < routed).unsqueeze(-1), y, x)
    else:
        y = x
    y = y * top_k_weights[token, perm % k].unsqueeze(-1)
    out = torch.zeros_like(hidden_states)
    return out.index_add(0, token, y.to(hidden_states.dtype))


def _dbrx_experts(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor) -> torch.Tensor:
    """``DbrxExperts.forward``: ``hidden_states`` (b, s, h) or (T, h), ``top_k_index`` and
    ``top_k_weights`` (T, k); expert e's gate, up and down weights are rows e·F:(e+1)·F of
    ``mlp.w1``, ``mlp.v1`` and ``mlp.w2`` (E·F, h); each token's k outputs weighted and
    added in expert order, as the family's loop adds them. Returns (b, T/b, h)."""
    batch, k = hidden_states.shape[0], top_k_index.shape[-1]
    x = hidden_states.reshape(-1, self.hidden_size)
    experts = (self.num_experts, self.ffn_hidden_size, self.hidden_size)
    _, perm, token, offs = _sort_by_expert(top_k_index, self.num_experts)
    rows = x[token]  # (S, h), sorted by expert
    gate = _grouped_linear(rows, self.mlp.w1.view(experts), offs)
    up = _grouped_linear(rows, self.mlp.v1.view(experts), offs)
    down = self.mlp.w2.view(experts).transpose(-2, -1)  # x @ w2[e]: (E, out=h, in=F)
    y = _grouped_linear(self.mlp.activation_fn(gate) * up, down, offs)
    y = y * top_k_weights[token, perm % k].unsqueeze(-1)
    out = torch.zeros_like(x).index_add(0, token, y.to(x.dtype))
    return out.view(batch, -1, self.hidden_size)


STATIC_FORWARDS: dict[str, Callable] = {
    "transformers.models.jetmoe.modeling_jetmoe.JetMoeTopKGating": _jetmoe_gating,
    "transformers.models.jetmoe.modeling_jetmoe.JetMoeParallelExperts":
        _jetmoe_parallel_experts,
    "transformers.models.longcat_flash.modeling_longcat_flash.LongcatFlashExperts":
        _longcat_experts,
    "transformers.models.dbrx.modeling_dbrx.DbrxExperts": _dbrx_experts,
}
"""Module class (``module.qualname``) -> the static form its instances run while captured."""


@contextlib.contextmanager
def static_experts(model: nn.Module) -> Iterator[int]:
    """While open, every submodule of ``model`` whose class :data:`STATIC_FORWARDS` names
    runs its static form (an instance attribute ``forward``, removed on exit, also when
    the body raises), and a transformers model configured for ``"eager"`` experts runs
    the ``"grouped_mm"`` ones (restored on exit). Yields how many modules it switched."""
    switched = []
    eager = getattr(getattr(model, "config", None), "_experts_implementation", None) == "eager" \
        and getattr(model, "_can_set_experts_implementation", lambda: False)()
    if eager:
        model.set_experts_implementation("grouped_mm")
    for module in model.modules():
        cls = type(module)
        form = STATIC_FORWARDS.get(f"{cls.__module__}.{cls.__qualname__}")
        if form is not None and "forward" not in vars(module):
            module.forward = types.MethodType(form, module)
            switched.append(module)
    try:
        yield len(switched)
    finally:
        for module in switched:
            del module.forward
        if eager:
            model.set_experts_implementation("eager")
