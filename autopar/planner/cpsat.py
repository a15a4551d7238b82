r"""Stage 3: choose the plan with OR-Tools CP-SAT.

The outer search enumerates mesh shapes (t, p, d) with t·p·d = N and micro-batch sizes b
(:func:`autopar.planner.search.candidate_configs`); for each, one CP-SAT model chooses jointly

* a TP strategy per node, :math:`x_{n,k} \in \{0,1\}`, :math:`\sum_k x_{n,k} = 1`; identical
  transformer layers share one template, so the layer's choice is solved once;
* edge transitions :math:`e_{uv,kl} \ge x_{u,k} + x_{v,l} - 1` priced by the resharding
  collectives they imply (forbidden pairs: :math:`x_{u,k} + x_{v,l} \le 1`);
* Megatron's f: :math:`f_u \ge x_{v,l}` for consumers whose strategy makes u's gradient
  partial (one backward all-reduce of u, shared by all such consumers);
* pipeline cuts: :math:`n_i \ge 1` layers on stage i, :math:`\sum_i n_i = L`, contiguous;
* recompute: :math:`r^{full}_i + r^{sel}_i \le n_i` layers of stage i;
* ZeRO stage :math:`z_j`, one-hot;

minimising the 1F1B/GPipe step time
:math:`(m-1)\,T_{max} + \sum_i T_i + (p-1)\,c_{p2p} + T_{dp}` with :math:`T_{max} \ge T_i + c_{p2p}`
and :math:`T_{dp} \ge D_i - B_i` (stage i's gradient reduction less the backward of its
last micro-batch, which bucketed reduction overlaps),
:math:`T_i = n_i (F_L + B_L) + r^{full}_i R_L + r^{sel}_i C_L + [i=0] T_{pre} + [i=p-1] T_{post}`
(:math:`R_L`: the forward that full recompute repeats, up to the layer's last saved tensor),
subject to per-GPU memory
:math:`\text{states}_i + \text{inflight}_i \cdot \text{act}_i \le M` for every stage.
Products of two decision variables are exact CP-SAT multiplication constraints. Each
constraint family has one ``add_*`` method and named constraints so an infeasible
model says which family binds. Times are integers in a unit of about 1e-4 of one layer's
forward+backward (``time_unit_s``), memory integer KiB, parameters integer units of 1024.
Stage sizes are searched within ±2 layers of an even split (``STAGE_SLACK``).

Interleaved 1F1B (v > 1 virtual stages per rank): the layers are cut into p·v equal chunks
of L/(p·v), as Megatron-LM requires, chunk c on rank c % p (``Plan.stage_layers``), so
:math:`n_i = L/p` is fixed and the solver still chooses the TP strategies, the ZeRO stage
and per rank the recompute counts (a rank's memory sums its v chunks; in-flight
micro-batches from ``cost_models.memory.in_flight_micro_batches``). The objective is then
:math:`v \times` the interleaved step time of ``cost_models.pipeline``,
:math:`(v m - 1)\,T_{max} + \sum_i T_i + v (p-1)\,c_{p2p} + v (T_{dp} + T_{opt})` with
:math:`T_{max} \ge T_i + v\,c_{p2p}` (integer coefficients; v = 1 is the formula above).
Ties are broken toward the lower ZeRO stage (1 ns per stage: simpler runtime, equal cost).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ortools.sat.python import cp_model

from cost_models.memory import in_flight_micro_batches

from autopar.planner.cost_tables import (Config, CostTables, bytes_per_param, dp_comm_s_per_param, f_cost,
                   optimizer_s_per_param)
from autopar.graph.annotate import TracedModel, last_saver_index
from autopar.plan import RECOMPUTE_MODES, equal_chunks, rank_layers
from autopar.support import pipeline_problem
from autopar.planner.strategies import (NodeStrategies, gathers_for_partial_grad, param_split, partial_grad_input,
                         tensor_inputs, tied_groups)

__all__ = ["InfeasibleError", "Decision", "StageModel", "template_map",
           "stage_bounds_and_recompute"]

KIB = 1024
PARAM_UNIT = 1024   # parameters are counted in units of 1024 (rounded up)
STAGE_SLACK = 2     # stage i holds L/p ± 2 layers


class InfeasibleError(Exception):
    """No plan fits; the message gives the smallest memory any plan needs vs the device."""


@dataclass
class Decision:
    """What CP-SAT decided for one Config (strategy index per node of the full graph)."""

    config: Config
    strategy: dict[str, int]
    stage_layers: list[list[int]]
    recompute: list[str]
    zero_stage: int
    objective_s: float
    solve_time_s: float


def _precision_scale(coefs: list[float], digits: int = 4) -> int:
    """A power of ten K so that the smallest non-zero coefficient keeps ``digits``
    significant digits when multiplied by K and rounded (at most 1e6)."""
    small = min((c for c in coefs if c > 0), default=1.0)
    return int(min(1e6, max(1.0, 10 ** math.ceil(math.log10(10 ** digits / small)))))


def template_map(traced: TracedModel) -> dict[str, str]:
    """Map every node name to the node of the layer template (layer 0) it mirrors.

    Raises NotImplementedError when transformer layers are not identical op sequences.
    """
    tmpl = traced.layers[0]
    mapping = {n: n for n in traced.pre + traced.post + tmpl}
    for layer in traced.layers[1:]:
        kinds = [traced.nodes[n].kind for n in layer]
        if kinds != [traced.nodes[n].kind for n in tmpl]:
            raise NotImplementedError(
                f"layers of {traced.layer_prefix} are not identical op sequences; autopar "
                "solves one template layer and needs every layer to match it")
        mapping.update(zip(layer, tmpl))
    return mapping


class StageModel:
    """CP-SAT model of one Config; build with the ``add_*`` methods, then :meth:`solve`."""

    def __init__(self, traced: TracedModel, strategies: NodeStrategies, tables: CostTables,
                 cluster, *, zero_stages=(0,), recompute_modes=RECOMPUTE_MODES,
                 fixed_recompute: str | None = None, even_stages: bool = False) -> None:
        self.t, self.s, self.c, self.cluster = traced, strategies, tables, cluster
        self.cfg = tables.config
        self.m = cp_model.CpModel()
        self.zero_stages = tuple(zero_stages)
        self.recompute_modes = recompute_modes
        self.fixed_recompute = fixed_recompute
        self.even_stages = even_stages
        self.section = {n: "pre" for n in traced.pre} | {n: "post" for n in traced.post} \
            | {n: "layer" for n in traced.layers[0]}
        self.x: dict[str, list] = {}
        self.reshard: dict[tuple, object] = {}
        layer_s = sum(tables.node[n][0].fwd_s + tables.node[n][0].bwd_s for n in traced.layers[0])
        self.ns = 1e4 / max(layer_s, 1e-12)  # seconds -> integer time units
        self.terms = {sec: {k: [] for k in ("fwd", "bwd", "core", "rec", "act", "core_act", "param")}
                      for sec in ("pre", "layer", "post")}
        tmpl = traced.layers[0]
        self.position = {n: i for i, n in enumerate(tmpl)}
        self.last_saver = last_saver_index(traced.nodes, tmpl)

    # -- TP strategies ------------------------------------------------------------------
    def add_strategy_choice(self) -> None:
        for name in self.section:
            xs = [self.m.NewBoolVar(f"x[{name},{k}]") for k in range(len(self.s[name]))]
            self.m.AddExactlyOne(xs).WithName(f"one_strategy[{name}]")
            self.x[name] = xs
            sec = self.terms[self.section[name]]
            for k, cost in enumerate(self.c.node[name]):
                sec["fwd"].append((cost.fwd_s * self.ns, xs[k]))
                sec["bwd"].append((cost.bwd_s * self.ns, xs[k]))
                sec["core"].append((cost.core_fwd_s * self.ns, xs[k]))
                if self.position.get(name, len(self.position)) <= self.last_saver:
                    sec["rec"].append((cost.fwd_s * self.ns, xs[k]))
                sec["act"].append((cost.saved_bytes / KIB, xs[k]))
                sec["core_act"].append((cost.core_saved_bytes / KIB, xs[k]))
                sec["param"].append((cost.param_numel / PARAM_UNIT, xs[k]))

    def add_boundaries(self) -> None:
        """Activations crossing layer boundaries (pipeline cuts) are replicated."""
        for name in (self.t.pre[-1], self.t.layers[0][-1]):
            for k, strat in enumerate(self.s[name]):
                if not strat.output.is_replicated:
                    self.m.Add(self.x[name][k] == 0).WithName(f"boundary_replicated[{name}]")

    def add_tied(self) -> None:
        """Modules sharing a weight (token embedding and lm_head) split it the same way."""
        for group in tied_groups(self.t):
            group = [n for n in group if n in self.x]
            splits = {param_split(s) for n in group for s in self.s[n]}
            for split in splits:
                sums = [sum(x for x, s in zip(self.x[n], self.s[n]) if param_split(s) == split)
                        for n in group]
                for a, b in zip(sums, sums[1:]):
                    self.m.Add(a == b).WithName(f"tied[{split}]")

    def add_edges(self) -> None:
        nodes = self.t.nodes
        for node in self.t.gm.graph.nodes:
            if node.name not in self.section:
                continue
            for j, src in enumerate(tensor_inputs(node, nodes)):
                src_name = src.name if src.name in self.x else self.t.layers[0][-1]
                sec = self.terms[self.section[node.name]]
                table = self.c.edge[(src.name, node.name, j)]
                self._add_edge(src_name, node.name, j, table, sec)

    def _add_edge(self, u: str, v: str, j: int, table, sec) -> None:
        """Price edge u -> v (input j). A reshard of u into one placement is shared by all
        consumers in a section (the rewriter inserts one collective), as is Megatron's f."""
        section = self.section[v]
        for ku, su in enumerate(self.s[u]):
            for kv, sv in enumerate(self.s[v]):
                cost = table.get((ku, kv))
                xu, xv = self.x[u][ku], self.x[v][kv]
                if cost is None:
                    self.m.AddBoolOr([xu.Not(), xv.Not()]).WithName(f"reshard_offered[{u}->{v}]")
                    continue
                if partial_grad_input(sv, j):
                    kind, f_s = f_cost(self.c, u, su.output)  # all-reduce, or reduce-scatter
                    fkey = f"f[{u},{kind}]"
                    if fkey not in self.x:
                        self.x[fkey] = [self.m.NewBoolVar(fkey)]
                        sec["bwd"].append((f_s * self.ns, self.x[fkey][0]))
                    self.m.Add(self.x[fkey][0] >= xu + xv - 1)
                if cost.fwd_s or cost.bwd_s:
                    fused = gathers_for_partial_grad(sv, j, su.output)
                    rkey = (u, ku, sv.inputs[j], section, fused)
                    if rkey not in self.reshard:
                        r = self.m.NewBoolVar(f"reshard[{u},{ku}->{sv.inputs[j]}]")
                        self.reshard[rkey] = r
                        sec["fwd"].append((cost.fwd_s * self.ns, r))
                        sec["bwd"].append((cost.bwd_s * self.ns, r))
                        if section == "layer" and self.position.get(u, -1) < self.last_saver:
                            sec["rec"].append((cost.fwd_s * self.ns, r))
                    self.m.Add(self.reshard[rkey] >= xu + xv - 1)

    # -- sections as integer expressions -----------------------------------------------
    def _expr(self, sec: str, key: str):
        """Integer expression of a section quantity. Times round to the nearest unit (errors
        cancel); memory and parameters round up (a plan that fits really fits)."""
        rnd = round if key in ("fwd", "bwd", "core", "rec") else math.ceil
        return sum(int(rnd(c)) * v for c, v in self.terms[sec][key] if c)

    def _var(self, name: str, expr, ub: int):
        var = self.m.NewIntVar(0, ub, name)
        self.m.Add(var == expr)
        return var

    def _prod(self, name: str, a, b, ub: int):
        var = self.m.NewIntVar(0, ub, name)
        self.m.AddMultiplicationEquality(var, [a, b])
        return var

    def _ub(self, sec: str, key: str) -> int:
        return int(sum(math.ceil(c) for c, _ in self.terms[sec][key])) + 1

    # -- stages, recompute, ZeRO, memory, objective -------------------------------------
    def build(self) -> None:
        self.add_strategy_choice()
        self.add_boundaries()
        self.add_tied()
        self.add_edges()
        self.add_stages()
        self.add_zero()
        self.add_memory()
        self.add_objective()

    def add_stages(self) -> None:
        cfg, L = self.cfg, self.t.num_layers
        p = cfg.pp
        if p > L:
            raise ValueError(f"pp={p} exceeds the {L} layers")
        lo, hi = max(1, L // p - STAGE_SLACK), min(L - p + 1, -(-L // p) + STAGE_SLACK)
        self.n = [self.m.NewIntVar(lo, hi, f"layers[{i}]") for i in range(p)]
        self.m.Add(sum(self.n) == L).WithName("all_layers_placed")
        v = cfg.virtual_stages
        problem = pipeline_problem(cfg.schedule, p, cfg.num_micro_batches, L, v)
        if problem:
            raise ValueError(problem)
        if v > 1:  # interleaved: p·v equal chunks, v of them per rank
            for i in range(p):
                self.m.Add(self.n[i] == L // p).WithName("equal_chunks")
        if self.even_stages:  # hand layouts: Megatron splits layers evenly
            for i in range(p):
                self.m.Add(self.n[i] == L // p + (1 if i < L % p else 0)).WithName("even_stages")
        self.rf, self.rs = [], []
        for i in range(p):
            rf = self.m.NewIntVar(0, L, f"recompute_full[{i}]")
            rs = self.m.NewIntVar(0, L, f"recompute_selective[{i}]")
            self.m.Add(rf + rs <= self.n[i]).WithName(f"recompute_within_stage[{i}]")
            modes = self.recompute_modes if self.fixed_recompute is None else (self.fixed_recompute,)
            if "full" not in modes:
                self.m.Add(rf == 0)
            if "selective" not in modes:
                self.m.Add(rs == 0)
            if modes == ("full",):
                self.m.Add(rf == self.n[i])
            if modes == ("selective",):
                self.m.Add(rs == self.n[i])
            self.rf.append(rf)
            self.rs.append(rs)

    def add_zero(self) -> None:
        self.z = {z: self.m.NewBoolVar(f"zero[{z}]") for z in self.zero_stages}
        self.m.AddExactlyOne(self.z.values()).WithName("one_zero_stage")

    def _stage_params(self, i: int):
        p, L = self.cfg.pp, self.t.num_layers
        pl = self._var("params_layer", self._expr("layer", "param"), self._ub("layer", "param"))
        prod = self._prod(f"params_layers[{i}]", self.n[i], pl, L * self._ub("layer", "param"))
        extra = 0
        if i == 0:
            extra += self._expr("pre", "param")
        if i == p - 1:
            extra += self._expr("post", "param")
            if p == 1:  # a tied weight counted in pre and post is one tensor
                extra -= self._tied_param_expr()
        total_ub = L * self._ub("layer", "param") + self._ub("pre", "param") + self._ub("post", "param")
        return self._var(f"params[{i}]", prod + extra, total_ub), total_ub

    def _tied_param_expr(self):
        expr = 0
        for group in tied_groups(self.t):
            last = group[-1]
            if self.section.get(last) == "post":
                for k, cost in enumerate(self.c.node[last]):
                    expr += int(math.ceil(cost.param_numel / PARAM_UNIT)) * self.x[last][k]
        return expr

    def add_memory(self) -> None:
        cfg = self.cfg
        L, p, d = self.t.num_layers, cfg.pp, cfg.dp
        act_ub = self._ub("layer", "act")
        a_layer = self._var("act_layer", self._expr("layer", "act"), act_ub)
        a_sel = self._var("act_layer_selective", self._expr("layer", "act") - self._expr("layer", "core_act"), act_ub)
        ckpt = int(math.ceil(self.c.full_ckpt_bytes / KIB))
        self.state_terms = []
        for i in range(p):
            params, pub = self._stage_params(i)
            s_iz = {}
            for z, zb in self.z.items():
                s = self.m.NewIntVar(0, pub, f"params_if_zero[{i},{z}]")
                self.m.Add(s == params).OnlyEnforceIf(zb)
                self.m.Add(s == 0).OnlyEnforceIf(zb.Not())
                s_iz[z] = s
            self.state_terms.append(s_iz)
            # state KiB * d, exact integers: 16d, 4d+12, 2d+14, 16 bytes per parameter
            state_d_kib = sum(round(bytes_per_param(z, d, cfg.dtype) * d) * s for z, s in s_iz.items())
            keep = self.m.NewIntVar(0, L, f"layers_no_recompute[{i}]")
            self.m.Add(keep == self.n[i] - self.rf[i] - self.rs[i])
            act = (self._prod(f"act_kept[{i}]", keep, a_layer, L * act_ub)
                   + self._prod(f"act_sel[{i}]", self.rs[i], a_sel, L * act_ub) + ckpt * self.rf[i])
            if i == 0:
                act += self._expr("pre", "act")
            inflight = in_flight_micro_batches(cfg.schedule, p, i, cfg.num_micro_batches,
                                               cfg.virtual_stages)
            act_total = self._var(f"act_stage[{i}]", act, L * act_ub * 4 + self._ub("pre", "act"))
            extra = a_layer  # working set of the layer being recomputed / run
            if i == p - 1:
                extra = extra + self._expr("post", "act")
            # everything times d·v, in KiB (parameter units of 1024 make state bytes KiB);
            # inflight·v is an integer: chunk forwards in flight (v = 1: micro-batches)
            v = cfg.virtual_stages
            mem_dv = v * state_d_kib + d * (round(inflight * v) * act_total + v * extra)
            self.m.Add(mem_dv <= self.cluster.device.memory_bytes // KIB * d * v).WithName(
                f"memory[stage {i}]")

    def add_objective(self) -> None:
        cfg, L = self.cfg, self.t.num_layers
        fl = self._var("fwd_layer", self._expr("layer", "fwd"), self._ub("layer", "fwd"))
        bl = self._var("bwd_layer", self._expr("layer", "bwd"), self._ub("layer", "bwd"))
        cl = self._var("core_layer", self._expr("layer", "core"), self._ub("layer", "core"))
        rl = self._var("recompute_layer", self._expr("layer", "rec"), self._ub("layer", "rec"))
        fb = self._var("fwd_bwd_layer", fl + bl, self._ub("layer", "fwd") + self._ub("layer", "bwd"))
        p2p = int(math.ceil(self.c.p2p_s * self.ns))
        v = cfg.virtual_stages  # the objective is v × step time (exact integers)
        t_ub = L * (self._ub("layer", "fwd") * 2 + self._ub("layer", "bwd")) + sum(
            self._ub(s, k) for s in ("pre", "post") for k in ("fwd", "bwd")) + 1
        self.stage_t, self.stage_bwd = [], []
        for i in range(cfg.pp):
            bwd = self._prod(f"bwd_layers[{i}]", self.n[i], bl, t_ub)
            bwd += self._expr("pre", "bwd") if i == 0 else 0
            bwd += self._expr("post", "bwd") if i == cfg.pp - 1 else 0
            self.stage_bwd.append(bwd)
            t = (self._prod(f"t_layers[{i}]", self.n[i], fb, t_ub)
                 + self._prod(f"t_full[{i}]", self.rf[i], rl, t_ub)
                 + self._prod(f"t_sel[{i}]", self.rs[i], cl, t_ub))
            if i == 0:
                t += self._expr("pre", "fwd") + self._expr("pre", "bwd")
            if i == cfg.pp - 1:
                t += self._expr("post", "fwd") + self._expr("post", "bwd")
            self.stage_t.append(self._var(f"stage_time[{i}]", t, t_ub))
        tmax = self.m.NewIntVar(0, t_ub + v * p2p, "t_max")
        for t in self.stage_t:
            self.m.Add(tmax >= t + v * p2p)
        dp_coef = {z: dp_comm_s_per_param(z, self.cluster, cfg) * PARAM_UNIT * self.ns
                   for z in self.z}
        opt_coef = {z: optimizer_s_per_param(z, self.cluster, cfg) * PARAM_UNIT * self.ns
                    for z in self.z}
        k = _precision_scale(list(dp_coef.values()) + list(opt_coef.values()))
        limit = 10**17 // k  # keep tdp·k far from int64 overflow (CP-SAT rejects such models)
        tdp = self.m.NewIntVar(0, limit, "t_dp")
        topt = self.m.NewIntVar(0, limit, "t_optimizer")
        for i, s_iz in enumerate(self.state_terms):
            # DP reduction overlaps the last micro-batch's backward (bucketed DDP)
            self.m.Add(tdp * k >= sum(round(dp_coef[z] * k) * s for z, s in s_iz.items())
                       - k * self.stage_bwd[i])
            self.m.Add(topt * k >= sum(round(opt_coef[z] * k) * s for z, s in s_iz.items()))
        ties = sum(z * zb for z, zb in self.z.items())
        self.objective = (v * cfg.num_micro_batches - 1) * tmax + sum(self.stage_t) \
            + v * (cfg.pp - 1) * p2p + v * (tdp + topt) + ties
        self.m.Minimize(self.objective)

    def add_cutoff(self, step_time_s: float) -> None:
        """Only plans faster than ``step_time_s`` (the best found so far) are of interest."""
        v = self.cfg.virtual_stages
        self.m.Add(self.objective <= int(step_time_s * self.ns * v)).WithName("beats_incumbent")

    def solve(self, max_time_s: float = 10.0) -> tuple[int, cp_model.CpSolver]:
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = 1
        solver.parameters.max_deterministic_time = max_time_s
        solver.parameters.linearization_level = 2
        status = solver.Solve(self.m)
        if status == cp_model.MODEL_INVALID:
            raise RuntimeError(f"autopar built an invalid CP-SAT model: {self.m.Validate()}")
        return status, solver

    def decision(self, solver: cp_model.CpSolver, mapping: dict[str, str]) -> Decision:
        chosen = {n: next(k for k, x in enumerate(xs) if solver.Value(x))
                  for n, xs in self.x.items() if not n.startswith("f[")}
        strategy = {n: chosen[t] for n, t in mapping.items()}
        n = [solver.Value(v) for v in self.n]
        counts = [(solver.Value(self.rf[i]), solver.Value(self.rs[i])) for i in range(len(n))]
        bounds, recompute = stage_bounds_and_recompute(n, counts, self.cfg.virtual_stages)
        zero = next(z for z, zb in self.z.items() if solver.Value(zb))
        return Decision(self.cfg, strategy, bounds, recompute, zero,
                        solver.ObjectiveValue() / self.ns / self.cfg.virtual_stages,
                        solver.WallTime())


def stage_bounds_and_recompute(layers: list[int], counts: list[tuple[int, int]],
                               virtual_stages: int = 1) -> tuple[list[list[int]], list[str]]:
    """``Plan.stage_layers`` and the per-layer recompute modes from per-rank layer counts
    and (full, selective) recompute counts. v = 1: contiguous stages, each with its full
    then selective then plain layers. v > 1: p·v equal chunks (every count L/p), chunk c on
    rank c % p; rank i's recompute modes fill its layers in ascending order (the cost
    model prices a rank's layers alike, so the order does not matter)."""
    p, L = len(layers), sum(layers)
    if virtual_stages == 1:
        bounds, start = [], 0
        for count in layers:
            bounds.append([start, start + count])
            start += count
    else:
        bounds = equal_chunks(L, p * virtual_stages)
    recompute = ["none"] * L
    for i, (rf, rs) in enumerate(counts):
        mine = rank_layers(bounds, p, i)
        for l, mode in zip(mine, ["full"] * rf + ["selective"] * rs):
            recompute[l] = mode
    return bounds, recompute
