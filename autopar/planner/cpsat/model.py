r"""Step 3 of the flow: choose the plan of one Config with OR-Tools CP-SAT.

The outer search enumerates mesh shapes (t, p, d) with t·p·d = N and micro-batch sizes b
(:func:`autopar.planner.search.candidate_configs`); for each, one :class:`ConfigModel`
(all p pipeline ranks of that Config) chooses jointly

* a TP strategy per node, :math:`x_{n,k} \in \{0,1\}`, :math:`\sum_k x_{n,k} = 1`; identical
  transformer layers share one template, so the layer's choice is solved once
  (:meth:`~ConfigModel.add_strategy_choice`, :meth:`~ConfigModel.add_boundaries`,
  :meth:`~ConfigModel.add_tied`);
* edge transitions :math:`e_{uv,kl} \ge x_{u,k} + x_{v,l} - 1` priced by the resharding
  collectives they imply (forbidden pairs: :math:`x_{u,k} + x_{v,l} \le 1`);
* Megatron's f: :math:`f_u \ge x_{v,l}` for consumers whose strategy makes u's gradient
  partial (one backward all-reduce of u, shared by all such consumers)
  (:meth:`~ConfigModel.add_edges`), and each version of a tensor that a consumer keeps
  for backward adds its bytes to its section's activations
  (:mod:`autopar.planner.cpsat.edges`);
* pipeline cuts: :math:`n_i` layers on rank i within ``STAGE_SLACK`` of L/p,
  :math:`\sum_i n_i = L`, contiguous; recompute: :math:`r^{full}_i + r^{sel}_i \le n_i`
  (:meth:`~ConfigModel.add_stages`);
* ZeRO stage :math:`z_j`, one-hot (:meth:`~ConfigModel.add_zero`);

minimising the 1F1B/GPipe step time (:meth:`~ConfigModel.add_objective`)
:math:`(m-1)\,T_{max} + \sum_i T_i + (p-1)\,c_{p2p} + T_{dp} + T_{opt} + T_{end}` with
:math:`T_{max} \ge T_i + c_{p2p}`, :math:`T_{dp} \ge D_i - B_i` (rank i's gradient reduction
less the backward of its last micro-batch, which bucketed reduction overlaps),
:math:`T_{opt} \ge O_i` (its optimizer step; :mod:`autopar.planner.costs.step`), :math:`T_{end}` the
closing all-reduces (``CostTables.step_end_s``, a constant of the config) and
:math:`T_i = n_i (F_L + B_L) + r^{full}_i R_L + r^{sel}_i C_L + [i=0] T_{pre} + [i=p-1] T_{post}`
(:math:`R_L`: the forward that full recompute repeats, up to the layer's last saved tensor),
subject to per-GPU memory (:meth:`~ConfigModel.add_memory`) :math:`\text{states}_i +
\text{inflight}_i \cdot \text{act}_i + \text{working}_i \le M_i` for every rank (:math:`M_i`:
device memory less the rank's reserve, :mod:`autopar.planner.costs.reserve`); products of two
decision variables are exact CP-SAT multiplication constraints. Each constraint family has
one ``add_*`` method, every constraint a name; without the cutoff only ``memory[stage i]``
can be unsatisfiable, so an INFEASIBLE model means no plan of the Config fits. Times are
integers of about 1e-4 of a layer's forward+backward (``units_per_second``), memory KiB,
parameters units of 1024 (``PARAM_UNIT``). Under expert parallelism the DP, optimizer and
memory rows charge the experts' units ("expert_param") their expert-data-parallel group's.

v > 1 chunks per rank: p·v equal chunks of L/(p·v) placed by the schedule's record
(``Plan.stage_layers``), so :math:`n_i = L/p` (memory sums a rank's v chunks); the objective
is :math:`v \times` the interleaved step time,
:math:`(v m - 1)\,T_{max} + \sum_i T_i + v (p-1)\,c_{p2p} + v (T_{dp} + T_{opt} + T_{end})`,
:math:`T_{max} \ge T_i + v\,c_{p2p}`; a schedule priced by its order (a V) has the makespan
of ``cpsat_terms.OrderedMakespan`` for its pipeline term.
Ties are broken toward the lower ZeRO stage (1 unit per stage: simpler runtime, equal cost).
"""

from __future__ import annotations

import math

from ortools.sat.python import cp_model

from autopar.graph.annotate import TracedModel, last_saver_index
from autopar.contract.plan import RECOMPUTE_MODES
from autopar.planner.costs.tables import CostTables, dp_comm_s_per_param, optimizer_s_per_param
from autopar.planner.cpsat.edges import add_edges
from autopar.planner.cpsat.terms import (
    OrderedMakespan, SectionTerms, add_exposed_dp, add_recompute_rows, deferred_weight_grads,
    head_working_kib, if_chosen, int_var, ordered_pipeline, precision_scale, product_var,
    solve_deterministic, template_map, tied_param_units)
from autopar.planner.costs.decision import (Decision, InfeasibleError, stage_bounds_and_recompute,
                                      stage_size_range)
from autopar.planner.costs.reserve import usable_bytes
from autopar.planner.costs.step import (
    KIB, PARAM_UNIT, counts_tied_weight_once, expert_dp_saving_s_per_param,
    expert_optimizer_extra_s_per_param, expert_state_kib_times_d, head_rank, scaled_memory,
    scaled_memory_limit, state_kib_times_d)
from autopar.planner.strategies import NodeStrategies, param_split, tied_groups
from autopar.contract.support import pipeline_problem
from autopar.techniques.pipeline_schedules import pipeline_schedule

__all__ = ["ConfigModel", "InfeasibleError", "Decision", "template_map"]


class ConfigModel:
    """The CP-SAT model of one Config (all its pipeline ranks): :meth:`build`, :meth:`solve`,
    :meth:`decision` (the plan read back). Decision variables: ``choice[node][k]`` (x,
    strategy k of a pre/template/post node, and ``choice["f[u,kind]"]`` Megatron's f),
    ``reshard[...]`` (e, one per resharded tensor, target placement and section),
    ``kept[...]`` in ``kept_copy`` (a tensor version kept for backward), ``layers_on_rank[i]``
    (n_i), ``recompute_full[i]`` / ``recompute_selective[i]`` (r_i), ``zero[z]`` (the ZeRO
    one-hot).
    """

    def __init__(self, traced: TracedModel, strategies: NodeStrategies, tables: CostTables,
                 cluster, *, zero_stages=(0,), recompute_modes=RECOMPUTE_MODES,
                 fixed_recompute: str | None = None, even_stages: bool = False,
                 recompute_layout: str = "per_layer", assume_memory: bool = False,
                 allowed: dict[str, set[str]] | None = None) -> None:
        self.traced, self.strategies, self.tables, self.cluster = traced, strategies, tables, cluster
        self.cfg = tables.config
        self.model = cp_model.CpModel()
        self.zero_stages = tuple(zero_stages)
        self.recompute_modes = recompute_modes
        self.fixed_recompute = fixed_recompute
        self.even_stages = even_stages
        self.recompute_layout = recompute_layout  # autopar.contract.support.RuntimeSupport's
        self.allowed = allowed  # node -> strategy keys it may take (None: any)
        # assume_memory: each memory[stage i] row enforced by a literal fits[stage i], so an
        # INFEASIBLE solve under those assumptions names the stages that bind (its core)
        self.memory_literals: list | None = [] if assume_memory else None
        self.ordered: OrderedMakespan | None = None  # a schedule priced by its order
        self.section_of = {n: "pre" for n in traced.pre} | {n: "post" for n in traced.post} \
            | {n: "layer" for n in traced.layers[0]}
        self.choice: dict[str, list] = {}
        self.reshard: dict[tuple, object] = {}
        self.kept_copy: dict[tuple, object] = {}
        layer_s = sum(tables.node[n][0].fwd_s + tables.node[n][0].bwd_s for n in traced.layers[0])
        self.units_per_second = 1e4 / max(layer_s, 1e-12)  # seconds -> integer time units
        self.terms = SectionTerms()
        tmpl = traced.layers[0]
        self.position = {n: i for i, n in enumerate(tmpl)}
        self.last_saver = last_saver_index(traced.nodes, tmpl)

    def build(self) -> None:
        """Add every constraint family and the objective, in this order."""
        self.add_strategy_choice()
        self.add_boundaries()
        self.add_tied()
        self.add_edges()
        self.add_stages()
        self.add_zero()
        self.add_memory()
        self.add_objective()

    # -- TP strategies ------------------------------------------------------------------
    def add_strategy_choice(self) -> None:
        r"""``one_strategy[n]``: :math:`\sum_k x_{n,k} = 1` for every pre, template-layer
        and post node; each choice adds its forward, backward, recompute, activation and
        parameter coefficients to its section's terms; ``allowed_strategy[n]``: a strategy
        outside ``allowed`` (a target's placements) is not taken."""
        ups = self.units_per_second
        for name in self.section_of:
            xs = [self.model.NewBoolVar(f"x[{name},{k}]") for k in range(len(self.strategies[name]))]
            self.model.AddExactlyOne(xs).WithName(f"one_strategy[{name}]")
            for x, strategy in zip(xs, self.strategies[name]):
                if self.allowed is not None and strategy.key not in self.allowed[name]:
                    self.model.Add(x == 0).WithName(f"allowed_strategy[{name}]")
            self.choice[name] = xs
            section = self.section_of[name]
            for k, cost in enumerate(self.tables.node[name]):
                self.terms.add(section, "fwd", cost.fwd_s * ups, xs[k])
                self.terms.add(section, "bwd", cost.bwd_s * ups, xs[k])
                self.terms.add(section, "wgrad", cost.wgrad_s * ups, xs[k])
                self.terms.add(section, "core", cost.core_fwd_s * ups, xs[k])
                if self.position.get(name, len(self.position)) <= self.last_saver:
                    self.terms.add(section, "rec", cost.rec_s * ups, xs[k])
                self.terms.add(section, "act", cost.saved_bytes / KIB, xs[k])
                self.terms.add(section, "core_act", cost.core_saved_bytes / KIB, xs[k])
                self.terms.add(section, "param", cost.param_numel / PARAM_UNIT, xs[k])
                self.terms.add(section, "expert_param", cost.expert_param_numel / PARAM_UNIT, xs[k])
                self.terms.add(section, "temp", cost.temp_bytes / KIB, xs[k])
                if self.traced.nodes[name].kind == "output":  # the loss's saved softmax
                    self.terms.add(section, "loss_act", cost.saved_bytes / KIB, xs[k])

    def add_boundaries(self) -> None:
        r"""``boundary_replicated[n]``: :math:`x_{n,k} = 0` for every non-replicated output
        k of the nodes whose activation crosses a layer boundary (a pipeline cut)."""
        for name in (self.traced.pre[-1], self.traced.layers[0][-1]):
            for k, strat in enumerate(self.strategies[name]):
                if not strat.output.is_replicated:
                    self.model.Add(self.choice[name][k] == 0).WithName(f"boundary_replicated[{name}]")

    def add_tied(self) -> None:
        r"""``tied[split]``: modules sharing a weight (token embedding and lm_head) split it
        the same way: :math:`\sum_{k: split(k) = s} x_{a,k} = \sum_{k: split(k) = s} x_{b,k}`
        for every split s."""
        for group in tied_groups(self.traced):
            group = [n for n in group if n in self.choice]
            splits = {param_split(s) for n in group for s in self.strategies[n]}
            for split in splits:
                sums = [sum(x for x, s in zip(self.choice[n], self.strategies[n])
                            if param_split(s) == split) for n in group]
                for a, b in zip(sums, sums[1:]):
                    self.model.Add(a == b).WithName(f"tied[{split}]")

    def add_edges(self) -> None:
        """The edge rows (reshards, Megatron's f, kept tensor versions):
        :func:`autopar.planner.cpsat.edges.add_edges`."""
        add_edges(self)

    # -- stages, recompute, ZeRO ----------------------------------------------------------
    def add_stages(self) -> None:
        r"""``all_layers_placed``: :math:`\sum_i n_i = L` with :math:`n_i` within
        :data:`~autopar.planner.costs.decision.STAGE_SLACK` of L/p; ``equal_chunks``
        (interleaved): :math:`n_i = L/p`; ``even_stages`` (hand layouts, as Megatron):
        :math:`n_i = \lfloor L/p \rfloor + [i < L \bmod p]`;
        and the recompute counts of :func:`~autopar.planner.cpsat.terms.add_recompute_rows`
        (``recompute_layout`` "block" is "uniform" under interleaving). Raises
        ValueError for p > L or a schedule :func:`~autopar.contract.support.pipeline_problem` rejects."""
        cfg, L, model = self.cfg, self.traced.num_layers, self.model
        p = cfg.pp
        if p > L:
            raise ValueError(f"pp={p} exceeds the {L} layers; choose pp <= {L}")
        lo, hi = stage_size_range(L, p)
        self.layers_on_rank = [model.NewIntVar(lo, hi, f"layers[{i}]") for i in range(p)]
        n = self.layers_on_rank
        model.Add(sum(n) == L).WithName("all_layers_placed")
        v = cfg.virtual_stages
        problem = pipeline_problem(cfg.schedule, p, cfg.num_micro_batches, L, v)
        if problem:
            raise ValueError(problem)
        if v > 1:  # interleaved: p·v equal chunks, v of them per rank
            for i in range(p):
                model.Add(n[i] == L // p).WithName("equal_chunks")
        if self.even_stages:  # hand layouts: Megatron splits layers evenly
            for i in range(p):
                model.Add(n[i] == L // p + (1 if i < L % p else 0)).WithName("even_stages")
        modes = self.recompute_modes if self.fixed_recompute is None else (self.fixed_recompute,)
        layout = "uniform" if v > 1 and self.recompute_layout == "block" else self.recompute_layout
        self.recompute_full, self.recompute_selective = add_recompute_rows(model, n, L, modes,
                                                                           layout)

    def add_zero(self) -> None:
        r"""``one_zero_stage``: :math:`\sum_z \zeta_z = 1` over the allowed ZeRO stages."""
        self.zero = {z: self.model.NewBoolVar(f"zero[{z}]") for z in self.zero_stages}
        self.model.AddExactlyOne(self.zero.values()).WithName("one_zero_stage")

    # -- memory ---------------------------------------------------------------------------
    def _rank_params(self, i: int, key: str = "param"):
        r"""Parameter units of rank i, :math:`n_i P_L + [i=0] P_{pre} + [i=h] P_{post}` (h: the
        head's rank), less the tied weight once when both ends share a rank (``key``
        "expert_param": the experts' under expert parallelism, :math:`X_i`); (var, bound)."""
        terms, L, model = self.terms, self.traced.num_layers, self.model
        layer_ub = terms.upper_bound("layer", key)
        pl = int_var(model, f"{key}s_layer", terms.expr("layer", key), layer_ub)
        prod = product_var(model, f"{key}s_layers[{i}]", self.layers_on_rank[i], pl, L * layer_ub)
        extra = (terms.expr("pre", key) if i == 0 else 0) + \
            (terms.expr("post", key) if i == head_rank(self.cfg) else 0)
        if i == head_rank(self.cfg) and counts_tied_weight_once(self.cfg) and key == "param":
            extra -= tied_param_units(self.traced, self.tables, self.choice)  # counted twice
        total_ub = L * layer_ub + terms.upper_bound("pre", key) + terms.upper_bound("post", key)
        return int_var(model, f"{key}s[{i}]", prod + extra, total_ub), total_ub

    def add_memory(self) -> None:
        r"""``memory[stage i]`` for every pipeline rank i, in KiB times d·v
        (:func:`~autopar.planner.costs.step.scaled_memory`):
        :math:`v \sum_z \beta_z d\, P_{i,z} + d\,(\lceil\text{inflight}_i v\rfloor A_i + v
        W_i) \le d\,v\,M_i`, where :math:`M_i` is the device memory less rank i's reserve
        (:func:`~autopar.planner.costs.reserve.usable_bytes`: CUDA context, NCCL buffers,
        headroom, fragmentation, pipeline receive buffers, a DP bucket), :math:`P_{i,z}` =
        rank i's parameter units if ZeRO stage z is chosen, else 0 (``params_if_zero``),
        :math:`\beta_z d` the state KiB per unit times d
        (:func:`~autopar.planner.costs.step.state_kib_times_d`), :math:`A_i` the kept activations
        of one micro-batch (``act_stage``: plain layers, selective layers without the
        attention core, full-recompute checkpoints, the pre section on rank 0) and
        :math:`W_i` the working set (one layer's activations, the head and loss on the head's
        rank as long as it holds them, :func:`~autopar.planner.cpsat.terms.head_working_kib`,
        with the loss's fp32 temporaries of the chosen loss strategy)."""
        cfg, terms, model = self.cfg, self.terms, self.model
        L, p = self.traced.num_layers, cfg.pp
        act_ub = terms.upper_bound("layer", "act")
        a_layer = int_var(model, "act_layer", terms.expr("layer", "act"), act_ub)
        a_sel = int_var(model, "act_layer_selective",
                          terms.expr("layer", "act") - terms.expr("layer", "core_act"), act_ub)
        ckpt = int(math.ceil(self.tables.full_ckpt_bytes / KIB))
        self.params_if_zero, self.experts_if_zero = [], []
        for i in range(p):
            s_iz = if_chosen(model, f"params_if_zero[{i}]", *self._rank_params(i), self.zero)
            self.params_if_zero.append(s_iz)
            # expert parallelism: the experts' states sharded over their EDP group, not d
            x_iz = if_chosen(model, f"experts_if_zero[{i}]",
                             *self._rank_params(i, "expert_param"), self.zero) \
                if cfg.ep > 1 else {}
            self.experts_if_zero.append(x_iz)
            state_kib_d = sum(state_kib_times_d(z, cfg) * s for z, s in s_iz.items()) + \
                sum(expert_state_kib_times_d(z, cfg) * x for z, x in x_iz.items())
            rf, rs = self.recompute_full[i], self.recompute_selective[i]
            keep = int_var(model, f"layers_no_recompute[{i}]", self.layers_on_rank[i] - rf - rs, L)
            act = (product_var(model, f"act_kept[{i}]", keep, a_layer, L * act_ub)
                   + product_var(model, f"act_sel[{i}]", rs, a_sel, L * act_ub) + ckpt * rf)
            if i == 0:
                act += terms.expr("pre", "act")
            act_total = int_var(model, f"act_stage[{i}]", act,
                                L * act_ub * 4 + terms.upper_bound("pre", "act"))
            working = a_layer  # working set of the layer being recomputed / run
            if i == head_rank(cfg):
                working = working + head_working_kib(terms, cfg)
            limit = scaled_memory_limit(usable_bytes(self.tables.p2p_bytes, self.cluster, cfg, i), cfg)
            row = model.Add(scaled_memory(cfg, i, state_kib_d, act_total, working) <= limit)
            row.WithName(f"memory[stage {i}]")
            if self.memory_literals is not None:
                self.memory_literals.append(model.NewBoolVar(f"fits[stage {i}]"))
                row.OnlyEnforceIf(self.memory_literals[-1])

    # -- objective ------------------------------------------------------------------------
    def add_objective(self) -> None:
        r"""Minimise v × the step time (module docstring) with ``stage_time[i]``
        :math:`T_i`, ``t_max[i]`` :math:`T_{max} \ge T_i + v c_{p2p}`, ``t_dp[i]``
        :math:`K T_{dp} \ge \sum_z K\delta_z P_{i,z} - K B_i` and ``t_optimizer[i]``
        :math:`K T_{opt} \ge \sum_z K\omega_z P_{i,z}` (:math:`\delta_z, \omega_z`:
        :mod:`autopar.planner.costs.step`'s per-parameter seconds in time units per parameter
        unit, K = :func:`~autopar.planner.cpsat.terms.precision_scale`), plus the chosen ZeRO
        stage's DP latency (``CostTables.dp_latency_s``) and 1 unit per stage (ties: lower)."""
        cfg, L, terms, model = self.cfg, self.traced.num_layers, self.terms, self.model
        ub = terms.upper_bound
        fl = int_var(model, "fwd_layer", terms.expr("layer", "fwd"), ub("layer", "fwd"))
        bl = int_var(model, "bwd_layer", terms.expr("layer", "bwd"), ub("layer", "bwd"))
        cl = int_var(model, "core_layer", terms.expr("layer", "core"), ub("layer", "core"))
        rl = int_var(model, "recompute_layer", terms.expr("layer", "rec"), ub("layer", "rec"))
        fb = int_var(model, "fwd_bwd_layer", fl + bl, ub("layer", "fwd") + ub("layer", "bwd"))
        p2p = int(math.ceil(self.tables.p2p_s * self.units_per_second))
        v = cfg.virtual_stages  # the objective is v × step time (exact integers)
        t_ub = L * (ub("layer", "fwd") + ub("layer", "bwd") + max(ub("layer", k) for k in (
            "fwd", "rec", "core"))) + sum(ub(s, k) for s in ("pre", "post") for k in ("fwd", "bwd")) + 1
        self.rank_time, self.rank_bwd = [], []
        n, rf, rs = self.layers_on_rank, self.recompute_full, self.recompute_selective
        for i in range(cfg.pp):
            bwd = product_var(model, f"bwd_layers[{i}]", n[i], bl, t_ub)
            bwd += terms.expr("pre", "bwd") if i == 0 else 0
            bwd += terms.expr("post", "bwd") if i == head_rank(cfg) else 0
            self.rank_bwd.append(bwd)
            t = (product_var(model, f"t_layers[{i}]", n[i], fb, t_ub)
                 + product_var(model, f"t_full[{i}]", rf[i], rl, t_ub)
                 + product_var(model, f"t_sel[{i}]", rs[i], cl, t_ub))
            if i == 0:
                t += terms.expr("pre", "fwd") + terms.expr("pre", "bwd")
            if i == head_rank(cfg):
                t += terms.expr("post", "fwd") + terms.expr("post", "bwd")
            self.rank_time.append(int_var(model, f"stage_time[{i}]", t, t_ub))
        tmax = model.NewIntVar(0, t_ub + v * p2p, "t_max")
        for i, t in enumerate(self.rank_time):
            model.Add(tmax >= t + v * p2p).WithName(f"t_max[{i}]")
        tdp, topt = self._add_dp_and_optimizer()
        ups = self.units_per_second  # per ZeRO stage: v × its DP latency, + 1 unit per stage
        zero_terms = sum((z + v * int(math.ceil(self.tables.dp_latency_s[z] * ups))) * zb
                         for z, zb in self.zero.items())  # (ties go to the lower stage)
        end = int(math.ceil(self.tables.step_end_s * ups))  # a constant of the config
        record = pipeline_schedule(cfg.schedule)
        if record.placement != "loop":  # no closed form: the makespan of the record's order
            self.ordered = ordered_pipeline(model, terms, cfg, n, self.rank_time, fl, t_ub, p2p)
            pipeline = self.ordered.makespan
        else:
            pipeline = (v * cfg.num_micro_batches - 1) * tmax + sum(self.rank_time) \
                + v * (cfg.pp - 1) * p2p
            if record.split_backward:
                pipeline += deferred_weight_grads(model, terms, self.layers_on_rank, t_ub)
        self.objective = pipeline + v * (tdp + topt + end) + zero_terms
        model.Minimize(self.objective)

    def _add_dp_and_optimizer(self):
        """The exposed-DP and optimizer rows of :meth:`add_objective`; returns (T_dp, T_opt)."""
        ups, cluster, cfg = self.units_per_second, self.cluster, self.cfg
        dp_coef = {z: dp_comm_s_per_param(z, cluster, cfg) * PARAM_UNIT * ups for z in self.zero}
        opt_coef = {z: optimizer_s_per_param(z, cluster, cfg) * PARAM_UNIT * ups for z in self.zero}
        k = precision_scale(list(dp_coef.values()) + list(opt_coef.values()))
        self.param_unit_time = max(round(dp_coef[z] * k) + round(opt_coef[z] * k) for z in self.zero) / k
        limit = 10**17 // k  # keep tdp·k far from int64 overflow (CP-SAT rejects such models)
        tdp = self.model.NewIntVar(0, limit, "t_dp")
        topt = self.model.NewIntVar(0, limit, "t_optimizer")
        cheaper = {z: expert_dp_saving_s_per_param(cluster, cfg, z) * PARAM_UNIT * ups
                   for z in self.zero}  # expert parallelism: the EDP group's rates
        extra = {z: expert_optimizer_extra_s_per_param(cluster, cfg, z) * PARAM_UNIT * ups for z in self.zero}
        for i, (s_iz, x_iz) in enumerate(zip(self.params_if_zero, self.experts_if_zero)):
            add_exposed_dp(self.model, tdp, k, dp_coef, s_iz, self.rank_bwd[i],  # DP overlaps
                           cluster.device.comm_overlap, i, (cheaper, x_iz))  # the last backward
            self.model.Add(topt * k >= sum(round(opt_coef[z] * k) * s for z, s in s_iz.items())
                           + sum(round(extra[z] * k) * x for z, x in x_iz.items())
                           ).WithName(f"t_optimizer[{i}]")
        return tdp, topt

    def add_cutoff(self, step_time_s: float) -> None:
        """``beats_incumbent``: objective ≤ step_time_s·units_per_second·v (the best so far) + the
        most that rounding parameters up adds (a PARAM_UNIT per holding node and layer copy)."""
        v, L = self.cfg.virtual_stages, self.traced.num_layers
        holds = {n for n, costs in self.tables.node.items() if any(c.param_numel for c in costs)}
        count = sum(1 for n in self.section_of if n in holds and self.section_of[n] != "layer")
        count += L * sum(1 for n in self.traced.layers[0] if n in holds)
        rounding = v * self.param_unit_time * count
        self.model.Add(self.objective <= int(step_time_s * self.units_per_second * v + rounding)
                       ).WithName("beats_incumbent")

    # -- solve and read back --------------------------------------------------------------
    def solve(self, max_time_s: float = 10.0) -> tuple[int, cp_model.CpSolver]:
        """:func:`~autopar.planner.cpsat.terms.solve_deterministic` on this model, again after
        each ``OrderedMakespan.cut`` (a schedule priced by its order) that adds a row."""
        while True:
            status, solver = solve_deterministic(self.model, max_time_s)
            if self.ordered is None or status not in (cp_model.OPTIMAL, cp_model.FEASIBLE) \
                    or not self.ordered.cut(solver):
                return status, solver

    def decision(self, solver: cp_model.CpSolver, mapping: dict[str, str]) -> Decision:
        """The solved plan as a Decision over the full graph (``mapping``: node -> the
        template node it mirrors, :func:`template_map`)."""
        chosen = {n: next(k for k, x in enumerate(xs) if solver.Value(x))
                  for n, xs in self.choice.items() if not n.startswith("f[")}
        strategy = {n: chosen[t] for n, t in mapping.items()}
        n = [solver.Value(v) for v in self.layers_on_rank]
        counts = [(solver.Value(self.recompute_full[i]), solver.Value(self.recompute_selective[i]))
                  for i in range(len(n))]
        bounds, recompute = stage_bounds_and_recompute(n, counts, self.cfg.virtual_stages,
                                                       schedule=self.cfg.schedule)
        zero = next(z for z, zb in self.zero.items() if solver.Value(zb))
        return Decision(self.cfg, strategy, bounds, recompute, zero,
                        solver.ObjectiveValue() / self.units_per_second / self.cfg.virtual_stages,
                        solver.WallTime())
