"""Integer building blocks of the CP-SAT model (:mod:`autopar.planner.cpsat.model`).

A section (pre, the template layer, post) collects, per quantity, linear terms
``(coefficient, boolean variable)``: seconds already scaled to the model's time unit, memory
in KiB, parameters in units of :data:`~autopar.planner.costs.step.PARAM_UNIT`. :class:`SectionTerms`
turns them into integer expressions (times rounded to the nearest unit so errors cancel;
memory and parameters rounded up so a plan that fits really fits) and their upper bounds.
"""

from __future__ import annotations

import math

from ortools.sat.python import cp_model

from cost_models.pipeline import critical_path

from autopar.graph.annotate import TracedModel
from autopar.graph.export import user_frames
from autopar.planner.costs.step import PARAM_UNIT, head_rank
from autopar.planner.strategies import tied_groups
from autopar.techniques.pipeline_schedules import pipeline_schedule
from autopar.techniques.recompute_modes import recomputed_by

__all__ = ["SECTIONS", "TIME_KEYS", "SectionTerms", "template_map", "precision_scale", "int_var",
           "deferred_weight_grads", "OrderedMakespan", "ordered_pipeline",
           "product_var", "tied_param_units", "add_exposed_dp", "solve_deterministic",
           "add_recompute_rows", "RECOMPUTE_LAYOUTS", "polish_stages", "fix_strategies"]

RECOMPUTE_LAYOUTS = ("per_layer", "block", "uniform")
"""How recompute modes may be laid over the layers (``RuntimeSupport.recompute_layout``)."""

SECTIONS = ("pre", "layer", "post")
TIME_KEYS = ("fwd", "bwd", "wgrad", "core", "rec")
"""Per section: forward, backward, selective recompute (attention core forward), full
recompute (forward up to the last saved tensor); the other keys are memory and parameters:
"act" (saved activation KiB), "core_act" (the part selective recompute drops), "loss_act"
(the part the loss keeps: its fp32 softmax), "param", "temp" (KiB allocated and freed
within the step: the loss's fp32 logits), "expert_param" (the part of "param" that expert
parallelism holds, reduced over the expert-data-parallel group)."""
_KEYS = TIME_KEYS + ("act", "core_act", "loss_act", "param", "temp", "expert_param")


class SectionTerms:
    """Linear terms per section and quantity: ``terms[section][key] = [(coef, var), ...]``."""

    def __init__(self) -> None:
        self.terms = {section: {key: [] for key in _KEYS} for section in SECTIONS}

    def add(self, section: str, key: str, coef: float, var) -> None:
        """Add ``coef · var`` to ``section``'s quantity ``key``."""
        self.terms[section][key].append((coef, var))

    def expr(self, section: str, key: str):
        """Integer expression of a section quantity: times round to the nearest unit,
        memory and parameters round up."""
        rnd = round if key in TIME_KEYS else math.ceil
        return sum(int(rnd(c)) * v for c, v in self.terms[section][key] if c)

    def upper_bound(self, section: str, key: str) -> int:
        """An upper bound of :meth:`expr` (every term's coefficient rounded up, plus one)."""
        return int(sum(math.ceil(c) for c, _ in self.terms[section][key])) + 1


def template_map(traced: TracedModel) -> dict[str, str]:
    """Map every node name to the node of the layer template (layer 0) it mirrors.

    Captured models arrive with layers that differ already grouped
    (:func:`autopar.graph.layer_groups.group_layers`: leading and trailing odd layers in
    pre and post, groups of identical layers as the layers), so this holds for them.
    Raises NotImplementedError when the layers are still not identical op sequences (a
    TracedModel built without :func:`~autopar.graph.capture.trace_model`).
    """
    tmpl = traced.layers[0]
    mapping = {n: n for n in traced.pre + traced.post + tmpl}
    for i, layer in enumerate(traced.layers[1:], 1):
        kinds = [traced.nodes[n].kind for n in layer]
        if kinds != [traced.nodes[n].kind for n in tmpl]:
            raise NotImplementedError(
                f"layers of {traced.layer_prefix} are not identical op sequences "
                f"({_first_difference(traced, tmpl, layer, i)}); autopar solves one template "
                "layer and needs every layer to match it (group them: "
                "autopar.graph.layer_groups.group_layers)")
        mapping.update(zip(layer, tmpl))
    return mapping


def _first_difference(traced: TracedModel, tmpl: list[str], layer: list[str], i: int) -> str:
    """Where layer ``i`` first differs from layer 0: the two ops (name, kind) and the
    source line of the one in layer ``i`` (fx's ``stack_trace``), or their lengths."""
    for k, (a, b) in enumerate(zip(tmpl, layer)):
        if traced.nodes[a].kind != traced.nodes[b].kind:
            return (f"layer 0 op {k} is {a} ({traced.nodes[a].kind}), layer {i} op {k} is {b} "
                    f"({traced.nodes[b].kind}){_source(traced, b)}")
    return f"layer 0 has {len(tmpl)} ops, layer {i} has {len(layer)}, the same up to there"


def _source(traced: TracedModel, name: str) -> str:
    """", at <file:line of the user's code>" of node ``name`` (its innermost frame outside
    torch and autopar) when fx recorded one."""
    node = next((n for n in traced.gm.graph.nodes if n.name == name), None)
    trace = (node.meta.get("stack_trace") or "") if node is not None else ""
    frames = [f for f, _ in user_frames(trace) if "/torch/" not in f and "/autopar/" not in f]
    return f", at {frames[-1]}" if frames else ""


def precision_scale(coefs: list[float], digits: int = 4) -> int:
    """A power of ten K so that the smallest non-zero coefficient keeps ``digits``
    significant digits when multiplied by K and rounded (at most 1e6)."""
    small = min((c for c in coefs if c > 0), default=1.0)
    return int(min(1e6, max(1.0, 10 ** math.ceil(math.log10(10 ** digits / small)))))


def int_var(model: cp_model.CpModel, name: str, expr, ub: int):
    """An integer variable ``name`` in [0, ub] equal to ``expr`` (constraint ``name``)."""
    var = model.NewIntVar(0, ub, name)
    model.Add(var == expr).WithName(name)
    return var


def product_var(model: cp_model.CpModel, name: str, a, b, ub: int):
    """An integer variable ``name`` in [0, ub] equal to a·b (exact multiplication)."""
    var = model.NewIntVar(0, ub, name)
    model.AddMultiplicationEquality(var, [a, b]).WithName(name)
    return var


def tied_param_units(traced: TracedModel, tables, choice: dict[str, list]) -> object:
    """Parameter units (rounded up) of the tied weights the post section shares with the
    pre section, as a linear expression of the post nodes' strategy booleans ``choice``."""
    expr = 0
    for group in tied_groups(traced):
        last = group[-1]
        if last in traced.post:
            for k, cost in enumerate(tables.node[last]):
                expr += int(math.ceil(cost.param_numel / PARAM_UNIT)) * choice[last][k]
    return expr


def head_working_kib(terms: SectionTerms, cfg):
    """The head section's KiB the head rank holds at once: its tensors but the loss's for
    ``head_weight_inputs_in_flight`` micro-batches (to W under a split backward), the
    loss's saved softmax for ``head_in_flight`` (to B), and the loss's temporaries once
    (:class:`~autopar.techniques.pipeline_schedules.PipelineSchedule`; as ``predict``)."""
    record = pipeline_schedule(cfg.schedule)
    args = (cfg.pp, cfg.num_micro_batches, cfg.virtual_stages)
    loss = terms.expr("post", "loss_act")
    return ((terms.expr("post", "act") - loss) * record.head_weight_inputs_in_flight(*args)
            + loss * record.head_in_flight(*args) + terms.expr("post", "temp"))


def hint_strategies(cm, strategy: dict[str, int]) -> None:
    """Hint CP-SAT toward ``strategy`` (node name -> strategy index, e.g. the Decision of an
    already solved config with the same strategies): every strategy boolean of ``cm`` (a
    ConfigModel) of a node in it. A hint only steers the search; the optimum is the same."""
    for name, xs in cm.choice.items():
        if name in strategy:
            for k, x in enumerate(xs):
                cm.model.AddHint(x, k == strategy[name])


def fix_strategies(cm, strategy: dict[str, int]) -> None:
    """Fix every strategy boolean of ``cm`` (a ConfigModel) of a node in ``strategy`` (node
    name -> strategy index) to it (rows ``fixed[x]``): what is left to solve is the stages,
    recompute and ZeRO stage, a small model (:func:`polish_stages`)."""
    for name, xs in cm.choice.items():
        if name in strategy:
            for k, x in enumerate(xs):
                cm.model.Add(x == int(k == strategy[name])).WithName("fixed[x]")


def polish_stages(cm, solver: cp_model.CpSolver, max_time_s: float):
    """A FEASIBLE solve of ``cm`` (a built ConfigModel) improved where its pipeline cuts,
    recompute counts and ZeRO stage were left short of the best for the strategies it
    chose: the strategy booleans fixed to ``solver``'s values (rows ``polish[x]``, added to
    ``cm``'s model: build a new model for any other solve), the stage variables hinted with
    them, solved again within ``max_time_s`` of deterministic time. With the strategies
    fixed the rest is a small model CP-SAT closes quickly, where the joint model often
    leaves it several percent from its best (Llama 3 405B on 16,384 H100s, tp8·pp16·dp128:
    529,191 units after 5 s jointly, 501,749 proven in 1.8 s with the strategies fixed).
    Returns (status, solver) of that solve when its plan is strictly better, else None.
    The joint solve's objective bound stays the config's bound (this one holds only for
    those strategies)."""
    for xs in cm.choice.values():  # every boolean of ``choice``, Megatron's f[u] included
        for x in xs:  # (a one-literal list, possibly false: not a strategy index)
            cm.model.Add(x == solver.Value(x)).WithName("polish[x]")
    cm.model.ClearHints()
    for v in (*cm.layers_on_rank, *cm.recompute_full, *cm.recompute_selective, *cm.zero.values()):
        cm.model.AddHint(v, solver.Value(v))
    status, polished = cm.solve(max_time_s)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) and \
            polished.ObjectiveValue() < solver.ObjectiveValue():
        return status, polished
    return None


def if_chosen(model: cp_model.CpModel, name: str, value, bound: int, literals: dict) -> dict:
    """Per key of ``literals`` (Boolean variables, exactly one of them true), an IntVar in
    [0, ``bound``] equal to ``value`` where that key's literal holds, else 0 (rows and
    variables ``name[key]``)."""
    out = {}
    for key, literal in literals.items():
        s = model.NewIntVar(0, bound, f"{name}[{key}]")
        model.Add(s == value).WithName(f"{name}[{key}]").OnlyEnforceIf(literal)
        model.Add(s == 0).WithName(f"{name}[{key}]").OnlyEnforceIf(literal.Not())
        out[key] = s
    return out


def add_exposed_dp(model: cp_model.CpModel, tdp, k: int, dp_coef: dict, s_iz: dict, bwd,
                   overlap: float, i: int, cheaper: tuple | None = None) -> None:
    r"""Pipeline rank i's rows of the exposed DP time ``tdp`` (:func:`autopar.planner.costs.step.
    exposed_dp_s`), scaled by k: ``t_dp[i]`` :math:`K T_{dp} \ge \sum_z K\delta_z P_{i,z} - K B_i`
    (the reduction hides behind the last backward ``bwd``) and, when the device overlaps
    only a fraction f = ``overlap`` < 1 of it, ``t_dp_serial[i]``
    :math:`K T_{dp} \ge \sum_z K(1 - f)\delta_z P_{i,z}`. ``dp_coef[z]``: δ_z in time units per
    parameter unit; ``s_iz[z]``: rank i's parameter units if ZeRO stage z is chosen, else 0;
    ``cheaper``: ({z: δ_z − δ_{z,e}}, {z: X_{i,z}}): what an expert parameter unit's
    reduction over the expert-data-parallel group saves under each ZeRO stage, and rank i's
    expert parameter units if that stage is chosen, else 0 (expert parallelism; None
    without)."""
    c, x = cheaper or ({}, {})
    model.Add(tdp * k >= sum(round(dp_coef[z] * k) * s for z, s in s_iz.items())
              - sum(round(c[z] * k) * x[z] for z in x) - k * bwd).WithName(f"t_dp[{i}]")
    if overlap < 1:
        model.Add(tdp * k >= sum(round((1.0 - overlap) * dp_coef[z] * k) * s
                                 for z, s in s_iz.items())
                  - sum(round((1.0 - overlap) * c[z] * k) * x[z] for z in x)
                  ).WithName(f"t_dp_serial[{i}]")


def rank_weight_grads(model: cp_model.CpModel, terms: SectionTerms, layers_on_rank: list,
                      t_ub: int, head: int) -> list:
    r"""Per pipeline rank i, its weight-gradient time of one micro-batch as a linear
    expression: :math:`W_i = n_i W_L + [i=0] W_{pre} + [i=h] W_{post}` (h = ``head``, the
    rank of the post section), :math:`W_L` the variable ``wgrad_layer``."""
    wl = int_var(model, "wgrad_layer", terms.expr("layer", "wgrad"),
                 terms.upper_bound("layer", "wgrad"))
    return [product_var(model, f"wgrad_layers[{i}]", n, wl, t_ub)
            + (terms.expr("pre", "wgrad") if i == 0 else 0)
            + (terms.expr("post", "wgrad") if i == head else 0)
            for i, n in enumerate(layers_on_rank)]


def deferred_weight_grads(model: cp_model.CpModel, terms: SectionTerms, layers_on_rank: list,
                          t_ub: int):
    r"""The objective term of a split-backward schedule (v = 1), which runs the weight
    gradients :math:`W_i` (:func:`rank_weight_grads`, the post section on rank p - 1) in the
    fill and drain: :math:`-2\sum_i W_i + 2 W_{max}` with rows ``w_max[i]``
    :math:`W_{max} \ge W_i` (``cost_models.pipeline``; minimising drives :math:`W_{max}`
    to :math:`\max_i W_i`)."""
    w = rank_weight_grads(model, terms, layers_on_rank, t_ub, len(layers_on_rank) - 1)
    w_max = model.NewIntVar(0, t_ub, "w_max")
    for i, wi in enumerate(w):
        model.Add(w_max >= wi).WithName(f"w_max[{i}]")
    return 2 * w_max - 2 * sum(w)


class OrderedMakespan:
    r"""The makespan of pipeline ranks running their blocks in fixed ``orders`` (a schedule
    priced by its order, :func:`cost_models.pipeline.simulate_orders`), in v × time units,
    as lazily added longest paths.

    Block lengths (times v, so one chunk's share of rank i's seconds is the rank's whole):
    F ``forward[i]``, B ``backward[i]`` (recompute and input gradient), W
    ``weight_grad[i]``, BW (a whole backward) B + W; all but W then send for ``send`` units. The makespan is the longest
    path of the blocks' dependency graph, the largest of linear forms
    :math:`\sum_i a_i F_i + b_i B_i + w_i W_i + s\,\text{send}`, one per path: too many
    to write down, so each :meth:`cut` adds the critical path of a solution whose
    ``makespan`` falls short of its simulated one (``path[k]`` rows), and the solve repeats
    (:meth:`ConfigModel.solve`). The first row is the critical path at equal lengths. A
    relaxation's optimum whose makespan its own simulation confirms is the optimum.
    """

    def __init__(self, model: cp_model.CpModel, orders: list, virtual_stage, forward: list,
                 backward: list, weight_grad: list, send: int, horizon: int) -> None:
        self.model, self.orders, self.virtual_stage, self.send = model, orders, virtual_stage, send
        self.lengths = {kind: [int_var(model, f"{kind}_block[{i}]", expr, horizon)
                               for i, expr in enumerate(exprs)]
                        for kind, exprs in (("F", forward), ("B", backward), ("W", weight_grad))}
        self.makespan = model.NewIntVar(0, horizon, "makespan")
        self.rows = 0
        self._add(critical_path(orders, virtual_stage, lambda kind, i: 1.0)[1])

    def _length(self, kind: str, i: int):
        """Block (kind, rank i)'s length without its send, a variable or a sum of two."""
        if kind == "BW":
            return self.lengths["B"][i] + self.lengths["W"][i]
        return self.lengths[kind][i]

    def _add(self, counts: dict) -> None:
        sends = sum(n for (_, kind), n in counts.items() if kind != "W")
        path = sum(n * self._length(kind, i) for (i, kind), n in counts.items())
        self.model.Add(self.makespan >= path + sends * self.send).WithName(f"path[{self.rows}]")
        self.rows += 1

    def cut(self, solver: cp_model.CpSolver) -> bool:
        """Add the critical path of ``solver``'s block lengths when it is longer than its
        ``makespan``; True when a row was added (solve again)."""
        value = {kind: [solver.Value(x) for x in xs] for kind, xs in self.lengths.items()}
        value["BW"] = [b + w for b, w in zip(value["B"], value["W"])]
        length = lambda kind, i: value[kind][i] + (self.send if kind != "W" else 0)  # noqa: E731
        makespan, counts = critical_path(self.orders, self.virtual_stage, length)
        if makespan <= solver.Value(self.makespan):
            return False
        self._add(counts)
        return True


def ordered_pipeline(model: cp_model.CpModel, terms: SectionTerms, cfg, layers_on_rank: list,
                     rank_time: list, fwd_layer, t_ub: int, p2p: int) -> OrderedMakespan:
    r"""The :class:`OrderedMakespan` of ``cfg``'s schedule, priced by its order (a V
    placement), in v × time units: rank i's forward :math:`F_i = n_i F_L` + the pre
    section's on rank 0 + the post section's on the head's rank, its weight gradient
    :math:`W_i` alike, and the rest of ``rank_time[i]`` (backward and recompute) as its B;
    sends of v·c/2 (``p2p`` = c in time units)."""
    record = pipeline_schedule(cfg.schedule)
    p, m, v, head = cfg.pp, cfg.num_micro_batches, cfg.virtual_stages, head_rank(cfg)
    wgrad = rank_weight_grads(model, terms, layers_on_rank, t_ub, head)
    fwd = [product_var(model, f"fwd_layers[{i}]", n, fwd_layer, t_ub)
           + (terms.expr("pre", "fwd") if i == 0 else 0)
           + (terms.expr("post", "fwd") if i == head else 0)
           for i, n in enumerate(layers_on_rank)]
    bwd = [t - f - w for t, f, w in zip(rank_time, fwd, wgrad)]
    chunks = [record.rank_chunks(p, p * v, i) for i in range(p)]
    return OrderedMakespan(model, [record.order(p, m, i, v) for i in range(p)],
                           lambda i, c: chunks[i][c], fwd, bwd, wgrad, v * p2p // 2,
                           m * p * (t_ub + v * p2p))


def solve_deterministic(model: cp_model.CpModel, max_time_s: float) -> tuple[int, cp_model.CpSolver]:
    """Run CP-SAT with one worker and ``max_time_s`` of deterministic time (repeatable run to
    run; ``linearization_level=2`` for these assignment-shaped models); returns (status,
    solver). Raises RuntimeError for an invalid model (an autopar bug)."""
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_deterministic_time = max_time_s
    solver.parameters.linearization_level = 2
    status = solver.Solve(model)
    if status == cp_model.MODEL_INVALID:
        raise RuntimeError(f"autopar built an invalid CP-SAT model: {model.Validate()}")
    return status, solver


def add_recompute_rows(model: cp_model.CpModel, layers: list, num_layers: int,
                       modes: tuple[str, ...], layout: str = "per_layer") -> tuple[list, list]:
    r"""Per pipeline rank i, the counts :math:`r^{full}_i, r^{sel}_i` of its ``layers[i]``
    (:math:`n_i`, CP-SAT variables) recomputed fully and selectively; returns (full,
    selective) lists of variables. Rows: ``recompute_within_stage[i]``
    :math:`r^{full}_i + r^{sel}_i \le n_i`; ``recompute_mode[i]`` keeps the counts to the
    allowed ``modes`` (one mode: every layer); ``layout``
    (:data:`RECOMPUTE_LAYOUTS`):

    * "per_layer": nothing more;
    * "uniform": ``recompute_uniform[i]``, one mode for every layer of every rank
      (booleans :math:`u_{full}, u_{sel}`, :math:`u_{full} + u_{sel} \le 1`,
      :math:`r_i = n_i u`);
    * "block" (Megatron-LM's ``--recompute-method block --recompute-num-layers k``;
      ``--recompute-granularity`` is one of full and selective): ``recompute_block[i]``
      :math:`r^{full}_i = \min(k, n_i)` with one k for every stage, and selective on every
      layer or none, never both granularities.

    Raises ValueError for an unknown ``layout``."""
    if layout not in RECOMPUTE_LAYOUTS:
        raise ValueError(f"recompute_layout must be one of {RECOMPUTE_LAYOUTS}, got {layout!r}")
    L = num_layers
    full, selective = [], []
    allowed = recomputed_by(modes)
    if layout != "per_layer":
        use_full, use_sel = model.NewBoolVar("recompute_uses_full"), model.NewBoolVar(
            "recompute_uses_selective")
        model.Add(use_full + use_sel <= 1).WithName("recompute_one_granularity")
        k = model.NewIntVar(0, L, "recompute_num_layers") if layout == "block" else None
        if k is not None:
            model.Add(k == 0).WithName("recompute_block_k").OnlyEnforceIf(use_full.Not())
    for i, n in enumerate(layers):
        rf = model.NewIntVar(0, L, f"recompute_full[{i}]")
        rs = model.NewIntVar(0, L, f"recompute_selective[{i}]")
        model.Add(rf + rs <= n).WithName(f"recompute_within_stage[{i}]")
        if not allowed["layer"]:
            model.Add(rf == 0).WithName(f"recompute_mode[{i}]")
        if not allowed["attention_core"]:
            model.Add(rs == 0).WithName(f"recompute_mode[{i}]")
        if not allowed["nothing"]:  # every layer recomputes
            model.Add(rf + rs == n).WithName(f"recompute_mode[{i}]")
        if layout != "per_layer":
            model.Add(rs == n).WithName(f"recompute_uniform[{i}]").OnlyEnforceIf(use_sel)
            model.Add(rs == 0).WithName(f"recompute_uniform[{i}]").OnlyEnforceIf(use_sel.Not())
            if k is None:
                model.Add(rf == n).WithName(f"recompute_uniform[{i}]").OnlyEnforceIf(use_full)
            else:
                model.AddMinEquality(rf, [k, n]).WithName(f"recompute_block[{i}]")
            model.Add(rf == 0).WithName(f"recompute_uniform[{i}]").OnlyEnforceIf(use_full.Not())
        full.append(rf)
        selective.append(rs)
    return full, selective
