"""Expert parallelism (EP): a transformers experts module whose E experts are spread over ep ranks.

A mixture-of-experts layer sends each token to k of E expert MLPs. Under expert parallelism
rank r of the EP group keeps only experts ``[r·E/ep, (r+1)·E/ep)`` (a contiguous slice,
``Shard(0)`` on the expert dim, as Megatron-Core and torchtitan place them) and tokens travel
to their experts' ranks and back (Lepikhin et al. 2020, "GShard", section 2.2; DeepSeek-V3
report section 3.2.2)::

    home rank (T tokens, k slots)             expert rank (its E/ep experts)
    x (T, h) ─pairs─▶ (T·k, h) sorted by expert ─dispatch─▶ rows grouped by local expert
                                                              │ y_e = down_e(gate(up_e(x)))
    out (T, h) ◀─Σ_k w·y─ (T·k, h) ◀─────────combine──────── (rows, h)

:class:`ExpertParallelExperts` replaces a ``transformers`` 5.x experts module (the classes
decorated with ``use_experts_implementation``: MixtralExperts, Qwen3MoeExperts, OlmoeExperts,
GptOssExperts, ...) with the same ``forward(hidden_states (T, h), top_k_index (T, k),
top_k_weights (T, k)) -> (T, h)`` and the same math as transformers'
``grouped_mm_experts_forward``: ``gate_up = x W_gu[e]ᵀ (+ b)``, ``act = _apply_gate(gate_up)``
(``act_fn(gate) · up`` with the halves chunked, or the family's own gate), ``y = act
W_d[e]ᵀ (+ b)``, ``out_t = Σ_k w_{t,k} · y_{t,k}``. The router's weights multiply on the home
rank, so the router's gradient stays local; the k products are summed in a fixed order
(``view(T, k, h).sum(1)``), every sort is stable and every gather of token rows has unique
indices (no scatter-add races in backward), so a step repeats bit for bit.

**Parameter names (checkpoint mapping).** The module keeps the original's names, with dim 0
the local experts: ``gate_up_proj`` (or ``up_proj`` when the family has no gate),
``down_proj`` and, with biases, ``gate_up_proj_bias`` / ``up_proj_bias`` / ``down_proj_bias``.
So ``<prefix>.<name>`` here holds the original ``<prefix>.<name>[global_expert_slice()]``.

**Communication.** Rank r sends ``n_{r→d}`` rows of h values to each other rank d (its
(token, slot) pairs routed to d's experts; rows to itself stay in memory) and receives
``n_{s→r}`` from each s. Forward: dispatch sends Σ_{d≠r} n_{r→d}·h·bytes and receives
Σ_{s≠r} n_{s→r}·h·bytes; combine the reverse. Backward: the two all-to-alls again with the
splits swapped (the same bytes, roles exchanged), so a step sends and receives
2·(Σ_{d≠r} n_{r→d} + Σ_{s≠r} n_{s→r})·h·bytes. Balanced routing: n_{r→d} = T·k/ep, so each
all-to-all moves T·k·h·bytes·(ep−1)/ep (:func:`cost_models.moe.moe_dispatch_bytes`). Before the dispatch
one small all-to-all of int64 counts per expert (E/ep to each rank, forward only) tells every
rank what it will receive: (E − E/ep)·8 bytes each way. :func:`dispatch_bytes` gives these
numbers for the routing a step had.
"""

from __future__ import annotations

import copy
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import fx

from autopar.graph.experts import EXPERTS_INTERFACE, experts_shape, is_experts_module
from autopar.runtime.compat import all_to_all_single_autograd, grouped_mm
from autopar.techniques.expert_parallel import ep_problem

__all__ = ["ExpertParallelExperts", "dispatch_bytes", "shard_experts", "check_expert_parallel"]

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16)  # grouped_mm's CPU kernel (torch 2.13)


def _param_names(experts: nn.Module) -> list[str]:
    """The parameters an experts module of the interface must have, in order."""
    names = ["gate_up_proj" if experts.has_gate else "up_proj", "down_proj"]
    return names + ([f"{n}_bias" for n in names] if experts.has_bias else [])


def _refuse_unsupported(experts: nn.Module) -> None:
    """Raise when ``experts`` is not a stacked-experts module whose math this module repeats."""
    cls = type(experts).__name__
    missing = [a for a in EXPERTS_INTERFACE if not hasattr(experts, a)]
    if missing:
        raise TypeError(f"{cls} is not built by transformers' use_experts_implementation "
                        f"(missing {', '.join(missing)}): ExpertParallelExperts only repeats "
                        "that interface's math (grouped_mm_experts_forward); wrap a "
                        "transformers 5.x experts module such as MixtralExperts")
    if experts.has_post_expert_norm:
        raise NotImplementedError(f"{cls} applies a post-expert norm (has_post_expert_norm): "
                                  "ExpertParallelExperts does not shard or run it")
    if getattr(experts, "_is_expert_parallel", False):
        raise ValueError(f"{cls} is already sharded by transformers' own expert parallelism "
                         "(_is_expert_parallel): give ExpertParallelExperts the unsharded module")
    expected, E = _param_names(experts), getattr(experts, "num_experts", None)
    found = [n for n, _ in experts.named_parameters()]
    if sorted(found) != sorted(expected):
        raise TypeError(f"{cls} has parameters {found}, ExpertParallelExperts expects exactly "
                        f"{expected} (has_gate={experts.has_gate}, has_bias={experts.has_bias})")
    bad = [n for n in expected if getattr(experts, n).dim() != (3 if "bias" not in n else 2)
           or getattr(experts, n).size(0) != E]
    if not isinstance(E, int) or bad:
        raise TypeError(f"{cls}: expected num_experts E and parameters stacked on dim 0 of "
                        f"size E; not so for {bad or ['num_experts']}")


def _gate_of(experts: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation between the two projections, as the original computes it: its
    ``_apply_gate`` (gated families) or ``act_fn``, bound to a parameter-free shallow copy
    of the original (a family's gate reads scalars such as gpt_oss's ``alpha``/``limit``
    and ``act_fn``; the copy keeps those without keeping the full expert weights alive)."""
    holders = [n for n, m in experts.named_children()
               if any(True for _ in m.parameters()) or any(True for _ in m.buffers())]
    if holders:
        raise NotImplementedError(f"{type(experts).__name__}: sub-modules with parameters or "
                                  f"buffers ({holders}) are not sharded by ExpertParallelExperts")
    shell = copy.copy(experts)
    shell.__dict__.update(_parameters={}, _buffers={}, _modules=dict(experts._modules))
    return shell._apply_gate if experts.has_gate else shell.act_fn


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """The permutation that undoes ``perm`` (x[perm][_inverse(perm)] == x)."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


class ExpertParallelExperts(nn.Module):
    """This rank's E/ep experts of ``experts``, with tokens exchanged over ``ep_group``.

    experts: a transformers experts module (see the module docstring); left untouched,
        its local slice is copied.
    ep_group: the EP process group (None: the world); its size is ep, this rank's index in
        it r, and every rank of it must wrap the same module (same E, same weights).
    Raises TypeError / NotImplementedError / ValueError naming the class and what is not
    supported (another interface, a post-expert norm, E not divisible by ep, ...).
    """

    def __init__(self, experts: nn.Module, ep_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        _refuse_unsupported(experts)  # before any process group is asked
        self._gate = _gate_of(experts)
        self.ep_group = dist.group.WORLD if ep_group is None else ep_group
        self.ep, self.ep_rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
        self.num_experts = E = experts.num_experts  # global
        if E % self.ep:
            options = [d for d in range(1, E + 1) if E % d == 0]
            raise ValueError(f"{type(experts).__name__}: E={E} experts are not divisible by "
                             f"ep={self.ep}; choose ep in {options}")
        self.num_local_experts = self.num_experts // self.ep  # E/ep
        self.has_gate, self.has_bias = experts.has_gate, experts.has_bias
        self.is_transposed = experts.is_transposed
        self.family = type(experts).__name__
        self._names = _param_names(experts)
        local = self.global_expert_slice()
        for name in self._names:
            setattr(self, name, nn.Parameter(getattr(experts, name).detach()[local].clone(),
                                             requires_grad=getattr(experts, name).requires_grad))

    def global_expert_slice(self) -> slice:
        """The experts of the original module this rank holds: dim 0 of every parameter here
        is ``original.<same name>[global_expert_slice()]``."""
        start = self.ep_rank * self.num_local_experts
        return slice(start, start + self.num_local_experts)

    def extra_repr(self) -> str:
        s = self.global_expert_slice()
        return (f"{self.family}, experts [{s.start}, {s.stop}) of E={self.num_experts}, "
                f"ep={self.ep}, rank={self.ep_rank}")

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden_states (T, h), top_k_index (T, k) expert ids in [0, E), top_k_weights
        (T, k) -> (T, h): Σ_k w_{t,k} · expert_{t,k}(x_t), the experts wherever they live.
        Every rank of the EP group must call it (T may differ per rank, and may be 0)."""
        T, k = top_k_index.shape
        h, ep, El = hidden_states.size(-1), self.ep, self.num_local_experts
        # (a) the (token, slot) pairs, sorted by expert; stable: ties keep (token, slot) order
        expert_ids = top_k_index.reshape(-1)  # (T·k,)
        order = torch.sort(expert_ids, stable=True).indices  # (T·k,)
        pairs = hidden_states.unsqueeze(1).expand(T, k, h).reshape(T * k, h)[order]
        # (b) rows per expert: this rank's (E,) to every rank, a (ep, E/ep) matrix back
        sent_per_expert = _expert_counts(expert_ids, self.num_experts, self.family)
        received_per_expert = _exchange_counts(sent_per_expert, ep, self.ep_group)
        send_splits = sent_per_expert.view(ep, El).sum(1).tolist()
        recv_splits = received_per_expert.sum(1).tolist()
        # (c) dispatch: (T·k, h) -> (R, h), each source's chunk sorted by its expert
        received = all_to_all_single_autograd(pairs, recv_splits, send_splits, self.ep_group)
        # (d) regroup the chunks by local expert (stable: source rank order within one)
        local_ids = torch.arange(El, device=received.device).repeat(ep)  # (ep·E/ep,)
        local_ids = local_ids.repeat_interleave(received_per_expert.reshape(-1))  # (R,)
        regroup = torch.sort(local_ids, stable=True).indices  # (R,)
        rows_per_local = received_per_expert.sum(0)  # (E/ep,)
        y = self._mlp(received[regroup], rows_per_local)[_inverse(regroup)]  # (R, h)
        # (e) combine: the results back to their home ranks, in the order they were sent
        y = all_to_all_single_autograd(y, send_splits, recv_splits, self.ep_group)  # (T·k, h)
        # (f) (token, slot) order, router weights at home, Σ over k in a fixed order
        y = y[_inverse(order)] * top_k_weights.reshape(-1, 1)
        return y.view(T, k, h).sum(dim=1).to(hidden_states.dtype)

    def _mlp(self, x: torch.Tensor, rows_per_expert: torch.Tensor) -> torch.Tensor:
        """The local experts on ``x`` (S, h), rows grouped by local expert
        (``rows_per_expert`` (E/ep,) of them each): (S, h)."""
        first, counts = self._names[0], rows_per_expert.tolist()  # gate_up_proj or up_proj
        hidden = self._linear(x, getattr(self, first), self._bias(first), rows_per_expert, counts)
        return self._linear(self._gate(hidden), self.down_proj, self._bias("down_proj"),
                            rows_per_expert, counts)

    def _bias(self, weight_name: str) -> torch.Tensor | None:
        return getattr(self, f"{weight_name}_bias") if self.has_bias else None

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                rows_per_expert: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Row block e of ``x`` (S, in) times expert e's weight: one grouped matmul where its
        kernel runs (:func:`_grouped_mm_runs`), else a loop of matmuls (same products)."""
        w = weight if self.is_transposed else weight.transpose(-2, -1)  # (E/ep, in, out)
        if _grouped_mm_runs(x, w):
            offs = torch.cumsum(rows_per_expert, 0, dtype=torch.int32)
            y = grouped_mm(x, w, offs=offs)
        else:
            y = torch.cat([xe @ we for xe, we in zip(x.split(counts), w.unbind(0))])
        if bias is not None:
            y = y + bias.repeat_interleave(rows_per_expert, dim=0, output_size=x.size(0))
        return y


def _grouped_mm_runs(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``grouped_mm`` has a kernel for ``x`` (S, in) and ``w`` (G, in, out): on the CPU
    (torch 2.13) for float32/bfloat16 with rows of a multiple of 16 bytes; float64 has no
    kernel, and other devices are not checked yet (the loop runs there)."""
    if grouped_mm is None or x.device.type != "cpu" or x.dtype not in _GROUPED_MM_DTYPES:
        return False
    return w.dtype == x.dtype and all(n * x.element_size() % 16 == 0 for n in w.shape[1:])


def _expert_counts(expert_ids: torch.Tensor, num_experts: int, family: str) -> torch.Tensor:
    """(E,) int64: how many of ``expert_ids`` go to each expert (refusing ids outside [0, E),
    such as transformers' EP sentinels)."""
    if expert_ids.numel() and (expert_ids.min() < 0 or expert_ids.max() >= num_experts):
        raise ValueError(f"{family}: top_k_index holds expert ids outside [0, {num_experts}) "
                         f"({expert_ids.min().item()}..{expert_ids.max().item()})")
    return torch.bincount(expert_ids, minlength=num_experts).to(torch.int64)


def _exchange_counts(sent_per_expert: torch.Tensor, ep: int,
                     group: dist.ProcessGroup | None) -> torch.Tensor:
    """(ep, E/ep): row s holds how many rows source rank s sends to each local expert here
    (an all-to-all of E/ep int64 counts to each rank; no gradient)."""
    received = torch.empty_like(sent_per_expert)
    dist.all_to_all_single(received, sent_per_expert.contiguous(), group=group)
    return received.view(ep, -1)


def dispatch_bytes(top_k_indices: Sequence[torch.Tensor], num_experts: int, ep: int, rank: int,
                   hidden_size: int, dtype_bytes: int) -> dict[str, int]:
    """Bytes rank ``rank`` sends and receives in one forward of :class:`ExpertParallelExperts`.

    top_k_indices: every EP rank's routing that step, in EP-group rank order (``ep`` tensors
        (T_s, k) of expert ids; what a rank receives depends on the others' routing).
    num_experts: E; ep: the EP degree; rank: r, this rank's index in the EP group;
    hidden_size: h; dtype_bytes: bytes per value of the hidden states.
    Rows a rank routes to its own experts stay in memory and are not counted. Keys:
    ``dispatch_sent`` = Σ_{d≠r} n_{r→d}·h·bytes, ``dispatch_received`` = Σ_{s≠r} n_{s→r}·h·bytes,
    ``combine_sent`` = dispatch_received, ``combine_received`` = dispatch_sent (the backward
    repeats both all-to-alls with the roles swapped: per step each direction is twice
    dispatch_sent + dispatch_received), ``count_exchange`` = (E − E/ep)·8, the int64 counts
    sent (and received) before the dispatch, forward only.
    """
    if len(top_k_indices) != ep or num_experts % ep:
        raise ValueError(f"need one routing per EP rank ({len(top_k_indices)} given, ep={ep}) "
                         f"and E={num_experts} divisible by ep")
    local = num_experts // ep

    def rows(src: int, dst: int) -> int:  # n_{src→dst}: pairs of src routed to dst's experts
        owner = top_k_indices[src].reshape(-1) // local
        return int((owner == dst).sum())

    row_bytes = hidden_size * dtype_bytes
    sent = sum(rows(rank, d) for d in range(ep) if d != rank) * row_bytes
    received = sum(rows(s, rank) for s in range(ep) if s != rank) * row_bytes
    return {"dispatch_sent": sent, "dispatch_received": received, "combine_sent": received,
            "combine_received": sent, "count_exchange": (num_experts - local) * 8}



def shard_experts(chunks: Sequence[nn.Module], ep_group: dist.ProcessGroup,
                  is_experts: Callable[[nn.Module], bool]) -> dict[str, slice]:
    """Replace every experts module the graphs of ``chunks`` (this rank's fx GraphModules)
    call (``is_experts``: :func:`autopar.graph.experts.is_experts_module`) by its
    :class:`ExpertParallelExperts` over ``ep_group``, at the same path, so parameter names
    stay the original ones. The graphs nested in a chunk are searched too (a recompute
    checkpoint's ``body``: :mod:`autopar.rewrite.recompute`). Returns local parameter name
    (prefixed ``"j."`` by the chunk index when there are several chunks, as an
    ``nn.ModuleList`` of them names it) -> the slice of the original's dim 0 (experts) it
    holds. No collective; raises the constructor's errors (an unsupported experts class, E
    not divisible by ep), and RuntimeError when an experts module is left whole (one the
    search did not reach: every rank would hold all E experts, silently not EP)."""
    slices: dict[str, slice] = {}
    for j, chunk in enumerate(chunks):
        prefix = f"{j}." if len(chunks) > 1 else ""
        graphs = [(path, m) for path, m in chunk.named_modules() if isinstance(m, fx.GraphModule)]
        for path, gm in graphs:
            for node in gm.graph.nodes:
                if node.op != "call_module" or not is_experts(gm.get_submodule(node.target)):
                    continue
                sharded = ExpertParallelExperts(gm.get_submodule(node.target), ep_group)
                gm.set_submodule(node.target, sharded)
                where = f"{prefix}{path}." if path else prefix
                for name, _ in sharded.named_parameters():
                    slices[f"{where}{node.target}.{name}"] = sharded.global_expert_slice()
        left = [name for name, m in chunk.named_modules()
                if is_experts(m) and not isinstance(m, ExpertParallelExperts)]
        if left:
            raise RuntimeError(f"experts module(s) {left} of chunk {j} are called outside "
                               "the chunk's graphs and were not sharded over EP: a bug of "
                               "autopar's rewrite, please report it")
    return slices


def check_expert_parallel(plan, traced) -> None:
    """Raise ValueError when ``plan``'s ep does not run on ``traced`` (its captured model)
    (:func:`~autopar.techniques.expert_parallel.ep_problem`: ep | t·d, ep | E of every
    experts module the graph calls, ZeRO-0); local, no collective."""
    if plan.ep == 1:
        return
    gm = traced.gm
    calls = [gm.get_submodule(n.target) for n in gm.graph.nodes if n.op == "call_module"]
    experts = [experts_shape(m)["num_experts"] for m in calls if is_experts_module(m)]
    problem = ep_problem(plan.ep, plan.dp * plan.cp, plan.zero_stage, experts, tp=plan.tp,
                         seq_len=plan.seq_len // plan.cp)  # CP: folded over c·d, s/c tokens
    if problem:
        raise ValueError(f"{problem} (the plan's ep={plan.ep})")
