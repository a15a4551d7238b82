r"""Lower bounds that prune a search's configs before CP-SAT sees them (step 3 of the flow).

:func:`autopar.planner.search.branch_and_bound.search` visits the configs (mesh shape, micro-batch size,
schedule) in order of :func:`step_bound_s` (with the layer's least compute) and skips one
when a bound says it cannot beat the best plan found so far, or cannot fit device memory.
Every bound here holds for every plan the CP-SAT model of :mod:`autopar.planner.cpsat`
admits, so pruning never loses the optimum (memory: device memory less the reserve,
:mod:`autopar.planner.costs.reserve`); all quantities are those of
:mod:`autopar.planner.costs.tables`, per micro-batch and GPU, in seconds and bytes.

The pipeline step of :mod:`autopar.planner.cpsat` (v virtual stages, 1 for 1F1B and GPipe)
is :math:`((v m - 1)\,T_{max} + \sum_i T_i)/v` plus non-negative terms, so with
:math:`T_{max} \ge T_0` and :math:`\sum_i T_i \ge L\,\ell` (ℓ: a layer's least time)

.. math:: \text{step} \ge (m - 1/v)\,T_0 + L\,\ell / v,

where rank 0, holding the most micro-batches in flight and the embedding, pays for the
recompute its memory forces, and every plan for its DP reduction beyond the last backward,
its optimizer step and its sends (:func:`step_bound_s`).
"""

from __future__ import annotations

from dataclasses import dataclass


from autopar.graph.annotate import TracedModel, last_saver_index
from autopar.planner.costs.tables import (Config, CostTables, bytes_per_param, dp_comm_s_per_param,
                                         expert_data_parallel, node_cost,
                                         optimizer_s_per_param)
from autopar.planner.costs.decision import stage_size_range
from autopar.planner.costs.reserve import usable_bytes
from autopar.planner.strategies import NodeStrategies, tensor_inputs
from autopar.techniques.pipeline_schedules import pipeline_schedule
from autopar.techniques.recompute_modes import recomputed_by

__all__ = ["compute_bound_s", "min_layer_compute_s", "memory_lower_bound_bytes", "expert_params",
           "LayerPieces", "layer_pieces", "step_bound_s"]

MEMORY_ROUNDING = 1.001  # the solver rounds memory up to KiB per term: a bound allows for it


def compute_bound_s(traced: TracedModel, cfg: Config, layer_s: float) -> float:
    """A step time no plan of ``cfg`` beats: some rank holds at least ceil(L/p) layers
    (pigeonhole), each at least ``layer_s`` seconds, and all ranks hold L, so the
    objective of :mod:`autopar.planner.cpsat`, ((v m - 1)·T_max + Σ T_i)/v, is at least
    (m - 1/v)·ceil(L/p)·layer_s + L·layer_s/v; with p | L this is the balanced pipeline's
    (m + (p - 1)/v)·(L/p)·layer_s (``cost_models.pipeline``), and never below it."""
    L, p, m, v = traced.num_layers, cfg.pp, cfg.num_micro_batches, cfg.virtual_stages
    return (m - 1 / v) * -(-L // p) * layer_s + L * layer_s / v


def min_layer_compute_s(traced: TracedModel, strategies: NodeStrategies, cluster,
                        cfg: Config) -> float:
    """Forward+backward seconds of one layer, each node at its cheapest strategy and
    communication free (cheap: no CP-SAT; the first bound of every config)."""
    layer, total = set(traced.layers[0]), 0.0
    for node in traced.gm.graph.nodes:
        if node.name not in layer:
            continue
        info = traced.nodes[node.name]
        in_numel = sum(traced.nodes[n.name].numel for n in tensor_inputs(node, traced.nodes))
        total += min(c.fwd_s + c.bwd_s for c in (
            node_cost(info, st, cfg.micro_batch_size, cluster, cfg.tp, in_numel,
                      cfg.activation_bytes, cfg.attention, cfg.ep)
            for st in strategies[node.name]))
    return total


def expert_params(traced: TracedModel) -> int:
    """Parameter elements of the model's experts calls (nodes with ``extra["inner"]``), the
    ones expert parallelism splits over ep ranks."""
    return sum(i.param_numel for i in traced.nodes.values() if i.extra.get("inner"))


def memory_lower_bound_bytes(traced: TracedModel, cfg: Config, zero_stages,
                             total_params: int | None = None,
                             experts: int | None = None) -> float:
    """Per-GPU memory no plan of ``cfg`` can go below: the largest stage holds at least the
    average model states (with the most sharding ZeRO allowed), and the stage with the most
    layers (>= ceil(L/p)) keeps at least their full-recompute checkpoints.
    ``total_params``: ``traced.total_params()`` when already known (a walk of every node);
    ``experts``: :func:`expert_params` alike."""
    total = traced.total_params() if total_params is None else total_params
    if cfg.ep > 1:  # the experts' parameters are split over ep ranks (replicated over TP)
        total -= (1 - 1 / cfg.ep) * (expert_params(traced) if experts is None else experts)
    states = total / (cfg.tp * cfg.pp) * min(
        bytes_per_param(z, cfg.dp, cfg.dtype, cfg.grad_dtype) for z in zero_stages)
    layers = -(-traced.num_layers // cfg.pp)
    ckpt = cfg.activation_bytes * traced.boundary_numel() * cfg.micro_batch_size * layers
    return max(states, ckpt)


def _least(tables: CostTables, names: list[str], field: str) -> float:
    """Σ over ``names`` of each node's least ``field`` over its strategies."""
    return sum(min(getattr(c, field) for c in tables.node[n]) for n in names)


def _least_kept(traced: TracedModel, tables: CostTables, names: list[str],
                boundary: str | None, graph: dict | None = None) -> float:
    """Bytes a section keeps at least of the tensors its savers read (its own nodes' and
    its input ``boundary``'s; :attr:`~autopar.planner.costs.tables.EdgeCost.saved_bytes`):
    per tensor, the smallest version any of them could keep."""
    members, least = set(names), {}
    graph = {n.name: n for n in traced.gm.graph.nodes} if graph is None else graph
    for v in names:
        for j, u in enumerate(tensor_inputs(graph[v], traced.nodes)):
            if u.name not in members and u.name != boundary:
                continue
            sizes = [c.saved_bytes for c in tables.edge[(u.name, v, j)].values() if c is not None]
            if sizes and min(sizes) > 0:
                least[u.name] = min(least.get(u.name, float("inf")), min(sizes))
    return sum(least.values())


def _recompute_s(need: float, n: int, full: tuple[float, float], sel: tuple[float, float],
                 modes) -> float:
    """Least recompute seconds that free ``need`` bytes per micro-batch from n layers, each
    layer recomputed at most once: the LP relaxation of choosing x full and y selective
    layers (x + y <= n; ``full``, ``sel``: (bytes freed, seconds) per layer; ``modes``: the
    recompute modes allowed). inf when even recomputing every layer does not free enough."""
    if need <= 0:
        return 0.0
    best = float("inf")
    allowed = recomputed_by(modes)
    kinds = [k for k, on in ((full, allowed["layer"]), (sel, allowed["attention_core"]))
             if on and k[0] > 0]
    for freed, cost in kinds:  # one kind only
        if need <= freed * n:
            best = min(best, need / freed * cost)
    if len(kinds) == 2 and kinds[0][0] != kinds[1][0]:  # both, on every layer: x + y = n
        (f1, c1), (f2, c2) = kinds
        x = (need - f2 * n) / (f1 - f2)
        if 0 <= x <= n:
            best = min(best, x * c1 + (n - x) * c2)
    return best


@dataclass(frozen=True)
class LayerPieces:
    """What :func:`step_bound_s` reads of one :class:`CostTables` (it depends only on tp,
    the micro-batch size, the dtype, attention and sequence parallelism, so a search
    computes it once per such key): per micro-batch and GPU, bytes a layer keeps at
    least (``act``), at least with selective recompute (``sel``), full recompute's
    (bytes freed, least seconds) per layer (``full``), selective's (``selective``), the
    pre section's least kept bytes (``pre_act``), the least parameter elements of a
    layer and of the pre section (``layer_params``, ``pre_params``), and the least
    forward+backward seconds of the pre and the post section (``pre_s``, ``post_s``)."""

    act: float
    sel: float
    full: tuple[float, float]
    selective: tuple[float, float]
    pre_act: float
    layer_params: float
    pre_params: float
    pre_s: float = 0.0
    post_s: float = 0.0


def layer_pieces(traced: TracedModel, tables: CostTables,
                 layer_kept: tuple[float, float] | None = None,
                 graph: dict | None = None) -> LayerPieces:
    """The :class:`LayerPieces` of ``tables``; ``layer_kept``: lower bounds on a layer's
    kept bytes without and with selective recompute over whole strategy choices
    (:func:`~autopar.planner.search.layer_bounds.min_layer_kept_bytes`), tighter than each node's
    least (the default); ``graph``: node name -> fx node of ``traced`` when already known."""
    layer, pre = traced.layers[0], traced.pre
    graph = {n.name: n for n in traced.gm.graph.nodes} if graph is None else graph
    kept = _least_kept(traced, tables, layer, pre[-1], graph)
    act = _least(tables, layer, "saved_bytes") + kept
    sel = sum(min(c.saved_bytes - c.core_saved_bytes for c in tables.node[n]) for n in layer) + kept
    if layer_kept is not None:
        act, sel = max(act, layer_kept[0]), max(sel, layer_kept[1])
    last = last_saver_index(traced.nodes, layer)
    return LayerPieces(
        act=act, sel=sel,
        full=((act - tables.full_ckpt_bytes), _least(tables, layer[: last + 1], "rec_s")),
        selective=((act - sel), _least(tables, layer, "core_fwd_s")),
        pre_act=_least(tables, pre, "saved_bytes") + _least_kept(traced, tables, pre, None,
                                                                 graph),
        layer_params=_least(tables, layer, "param_numel"),
        pre_params=_least(tables, pre, "param_numel"),
        pre_s=_least_time(tables, pre), post_s=_least_time(tables, traced.post))


def _least_time(tables: CostTables, names: list[str]) -> float:
    """Σ over ``names`` of each node's least forward+backward seconds."""
    return sum(min(c.fwd_s + c.bwd_s for c in tables.node[n]) for n in names)


def _sends_bound_s(record, p: int, m: int, v: int, p2p_s: float) -> float:
    """Seconds of sends every plan pays: each rank sends after each of its v·m forwards
    and backwards (c/2 each); a round-robin fill and drain crosses the p - 1 boundaries
    besides. 0 at p = 1."""
    if p == 1:
        return 0.0
    return ((v * m + p - 2) if record.placement == "loop" else v * m) * p2p_s


def step_bound_s(traced: TracedModel, tables: CostTables, cfg: Config, layer_s: float,
                 cluster, zero_stages, modes, pieces: LayerPieces | None = None) -> float:
    r"""A step time (seconds) no plan of ``cfg`` beats, with the recompute rank 0's memory
    forces, the largest rank's layers, the exposed DP reduction, the optimizer step, the
    pipeline sends and the step's constant collectives: minimised over the ZeRO stages z
    in ``zero_stages`` and rank 0's layer counts :math:`n_0`,

    .. math:: \frac{(v m - 1)\,\hat T + T_0 + (L - n_0)\,\ell + [p>1]\,T_{post}}{v}
              + (v m + p - 2)\,c + \max\big((1 - f)\,\delta_z P_0,\ \delta_z P_0 - T_0\big)
              + \omega_z P_0 + \lambda_z + T_{end},

    where :math:`T_0 \ge n_0 \ell + R_z(n_0) + T_{pre} (+ T_{post}` at p = 1) is rank 0's
    time (ℓ = ``layer_s``; R the least recompute, :func:`_recompute_s`, that brings rank
    0's memory under its usable bytes, device memory less the reserve,
    :func:`~autopar.planner.costs.reserve.usable_bytes`, with z's bytes per parameter: model
    states of its layers and the embedding, each node's least saved activations per
    micro-batch in flight, one working layer), :math:`\hat T = \max(T_0,
    \lceil L/p \rceil \ell)` (some rank holds at least ceil(L/p) layers),
    :math:`T_{pre}, T_{post}` the sections' least forward+backward, :math:`P_0 \ge n_0 P_L
    + P_{pre}` rank 0's parameters, c the send between stages (0 at p = 1),
    :math:`\delta_z, \omega_z` the DP and optimizer seconds per parameter
    (:mod:`autopar.planner.costs.step`), f the device's ``comm_overlap``, :math:`\lambda_z`
    the DP latency (``CostTables.dp_latency_s``) and :math:`T_{end}` the closing
    collectives (``CostTables.step_end_s``). Derivation, from the objective of
    :mod:`autopar.planner.cpsat`, :math:`v\,\text{pipe} = (v m - 1) T_{max} + \sum_i T_i
    + v (p-1) c` with :math:`T_{max} \ge \max_i T_i + v c \ge \hat T + v c` and
    :math:`\sum_{i>0} T_i \ge (L - n_0)\ell + [p>1] T_{post}`; the exposed DP time is at
    least :math:`\delta_z P_0 - B_0` with rank 0's last backward :math:`B_0 \le T_0`, and
    at least :math:`(1 - f)\delta_z P_0`, and the optimizer's at least :math:`\omega_z
    P_0`. A layer keeps at least the sum of its nodes' least saved bytes (a), selective
    at least the least without the attention core (s), full its checkpoint (c), so x full
    and y selective layers keep at least n·a - x(a - c) - y(a - s), at no less than the
    least forward up to the layer's last saver resp. the least attention-core forward
    each. A split backward may fill the fill and drain (and a V has no closed form): only
    :math:`m \hat T` remains of its pipeline term (:func:`_sends_bound_s`: the sends). inf
    when no (z, n_0) fits. ``pieces``: :func:`layer_pieces` (computed when None)."""
    pc = layer_pieces(traced, tables) if pieces is None else pieces
    L, p, m, v = traced.num_layers, cfg.pp, cfg.num_micro_batches, cfg.virtual_stages
    record = pipeline_schedule(cfg.schedule)
    inflight = record.in_flight(p, 0, m, v)
    lo, hi = (L // p, L // p) if v > 1 or p == 1 else stage_size_range(L, p)
    sends, largest = _sends_bound_s(record, p, m, v, tables.p2p_s), -(-L // p) * layer_s
    sections, post_rest = pc.pre_s + (pc.post_s if p == 1 else 0.0), pc.post_s * (p > 1)
    memory = usable_bytes(tables.p2p_bytes, cluster, cfg, 0) * MEMORY_ROUNDING
    best = float("inf")
    for z in zero_stages:
        per_param = bytes_per_param(z, cfg.dp, cfg.dtype, cfg.grad_dtype)
        dp_s, opt_s = dp_comm_s_per_param(z, cluster, cfg), optimizer_s_per_param(z, cluster, cfg)
        if cfg.ep > 1:  # expert gradients reduce over d/ep ranks: the cheaper rate bounds both
            dp_s = min(dp_s, dp_comm_s_per_param(z, cluster, expert_data_parallel(cfg)))
        for n in range(lo, hi + 1):
            params = n * pc.layer_params + pc.pre_params
            used = params * per_param + inflight * (n * pc.act + pc.pre_act) + pc.act
            t0 = n * layer_s + sections + _recompute_s((used - memory) / inflight, n, pc.full,
                                                       pc.selective, modes)
            if t0 == float("inf"):
                continue
            pipe = m * max(t0, largest) if record.split_backward else (  # W's in the bubble
                (v * m - 1) * max(t0, largest) + t0 + (L - n) * layer_s + post_rest) / v
            dp = max((1.0 - cluster.device.comm_overlap) * dp_s * params, dp_s * params - t0)
            best = min(best, pipe + sends + dp + opt_s * params + tables.dp_latency_s[z])
    return best + tables.step_end_s
