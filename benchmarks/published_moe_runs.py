"""Published mixture-of-experts (MoE) runs priced by autopar: does expert parallelism price right?

    python benchmarks/published_moe_runs.py          # print the table, update the report
    python benchmarks/published_moe_runs.py --fit    # the H100 matmul_efficiency M1 implies

Each row is a Megatron-Core MoE training run on H100 whose layout and throughput NVIDIA
publishes in its Megatron-MoE-ModelZoo (github.com/yanring/Megatron-MoE-ModelZoo, commit
e8650517d60d71ab73fc6b3b0388cac4ba435181): the model is built from its ``transformers``
config on the meta device, the published layout is priced with ``autopar.evaluate`` on the
``dgx-h100`` preset (expert-TP 1: the EP group spans TP, the experts on each TP rank's
sequence shard; ZeRO-1, the distributed optimizer, the experts' states over their
expert-data-parallel group), and the predicted step time is compared with the published one.

The published figure is Megatron-LM's "throughput per GPU (TFLOP/s/GPU)", which counts
:func:`megatron_flops_per_token` (``megatron/training/training.py`` ``transformer_flops``:
3 × forward, causal attention at half of s², routed experts at top-k, no router, no
recompute) over the step; that count times the step's tokens over the published TFLOP/s
gives the published step seconds exactly, which is what autopar's step time is compared
with (autopar counts its own FLOPs differently; TFLOP/s below are Megatron's count over
autopar's predicted step time).

Rows (``MOE_RUNS``), all priced with the ``dgx-h100`` preset as it is (its
``matmul_efficiency`` 0.55 is a placeholder: no H100 run has calibrated it). ``--fit``
prints the efficiency at which Mixtral 8x22B (M1, the run with the fewest features autopar
does not price) would match: it reaches the bound 1.0, i.e. the cost model charges these
MoE layers more non-GEMM time than Megatron spends (:data:`GAPS`), so M1 does not serve
as the H100 calibration. What Megatron ran that autopar does not price is listed per row
(``unpriced``): DeepEP's dispatcher (priced as the all-to-all of the same bytes; DeepEP
sends a token once per node over InfiniBand), selective recompute of Megatron's
``layernorm``/``moe_act`` modules (priced without recompute: it repeats the norms and the
SwiGLU only), TP-communication overlap. None of the rows used FP8, DualPipe or an
all-to-all overlapped with compute.

The memory model: autopar prices the memory of the program it runs, the ``transformers``
model's own code (its experts keep silu(gate), up and their product where Megatron's fused
SwiGLU keeps the first GEMM's output), so a published layout can exceed the device there;
``evaluate(check_memory=False)`` prices its time anyway and the report gives the margin.
"""

from __future__ import annotations

import argparse
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import autopar
from cost_models.hardware import Cluster

REPORT = Path(__file__).resolve().parents[1] / "reports" / "published_vs_predicted.md"
TOLERANCE = 0.15
SECTION = "## Mixture-of-experts runs (expert parallelism)"
END = "<!-- end of the mixture-of-experts section -->"
ZOO = "Megatron-MoE-ModelZoo@e865051"


@dataclass(frozen=True)
class MoERun:
    """One published MoE run. family/config: the ``transformers`` model type and its config
    fields; nodes: DGX H100 nodes; layout: ``autopar.Layout.parse`` text; batch (B) and seq
    (s); published: Megatron's TFLOP/s per GPU; stage_layers: Megatron's chunks when uneven
    ([first, last) per model chunk); role: "calibration" or "prediction"; unpriced: what
    the run used that autopar does not price; source: where each figure is."""

    name: str
    family: str
    config: dict
    nodes: int
    layout: str
    batch: int
    seq: int
    published: float
    source: str
    stage_layers: list | None = None
    role: str = "prediction"
    unpriced: tuple[str, ...] = field(default_factory=tuple)


MIXTRAL_8X22B = dict(vocab_size=32000, hidden_size=6144, intermediate_size=16384,
                     num_hidden_layers=56, num_attention_heads=48, num_key_value_heads=8,
                     num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False,
                     max_position_embeddings=65536)
QWEN3_235B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                  moe_intermediate_size=1536, num_hidden_layers=94, num_attention_heads=64,
                  num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                  norm_topk_prob=True, tie_word_embeddings=False, max_position_embeddings=40960)


def qwen3_chunks(pp: int, v: int, layers: int = 94) -> list[list[int]]:
    """Megatron's ``--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-
    split``: the embedding and the loss count as one layer each, the L + 2 units split evenly
    over the pp·v chunks, so the first and last chunks hold one decoder layer fewer."""
    per = (layers + 2) // (pp * v)
    sizes = [per - 1] + [per] * (pp * v - 2) + [per - 1]
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    return [[bounds[i], bounds[i + 1]] for i in range(len(sizes))]


MOE_RUNS: tuple[MoERun, ...] = (
    MoERun("Mixtral 8x22B (M1)", "mixtral", MIXTRAL_8X22B, 16,
           "tp=2,pp=8,dp=8,ep=8,v=7,mbs=1,sp=1,zero_stage=1,recompute=none,"
           "schedule=interleaved_1f1b", 256, 4096, 445.0,
           f"{ZOO} best_practice/mixtral/run_mixtral_8x22B.sh l.27 (dropless, 445 TFLOPS); "
           "runtime_configs/benchmarking/runtime.conf (TP2 PP8 EP8 VPP7 MBS1 GBS256, 16 nodes); "
           "model_configs/benchmarking/Mixtral-8x22B.yaml (expert-TP 1, SP, distributed "
           "optimizer, no recompute, V 32000)",
           unpriced=("TP-communication overlap",)),
    MoERun("Qwen3-235B-A22B, EP32 (Q1)", "qwen3_moe", QWEN3_235B, 32,
           "tp=2,pp=8,dp=16,ep=32,v=4,mbs=1,sp=1,zero_stage=1,recompute=none,"
           "schedule=interleaved_1f1b", 2048, 4096, 245.0,
           f"{ZOO} best_practice/qwen3/readme.md table row 1 (256 H100, BF16, TP2 PP8 VPP4 "
           "EP32, MBS1 GBS2048, 19.7 s, 245 TFLOPS); model_configs/benchmarking/"
           "Qwen3-235B-A22B.yaml (expert-TP 1, SP, distributed optimizer, embedding and loss "
           "counted in the pipeline split)",
           stage_layers=qwen3_chunks(8, 4),
           unpriced=("DeepEP dispatcher (priced as an all-to-all of the same bytes)",
                     "selective recompute of layernorm and moe_act (priced without)")),
    MoERun("Qwen3-235B-A22B, TP4 EP8 (Q5)", "qwen3_moe", QWEN3_235B, 32,
           "tp=4,pp=8,dp=8,ep=8,v=4,mbs=1,sp=1,zero_stage=1,recompute=none,"
           "schedule=interleaved_1f1b", 2048, 4096, 167.0,
           f"{ZOO} best_practice/qwen3/readme.md table row 5 (256 H100, BF16, TP4 PP8 VPP4 "
           "EP8, MBS1 GBS2048, no recompute, 29.0 s, 167 TFLOPS)",
           stage_layers=qwen3_chunks(8, 4),
           unpriced=("DeepEP dispatcher (priced as an all-to-all of the same bytes)",)),
)


GAPS = (
    "Where the time goes (M1 at matmul_efficiency 1.0, one layer and micro-batch on one GPU, "
    "forward + backward: 16.6 ms, of which the experts call 10.3 ms): (1) the host dispatch "
    "of about 40 shape ops per layer (views, slices, transposes, unsqueezes, parameter reads) "
    "is charged 2.2 ms, each op max(kernel, dispatch) and the ops summed, while a host that "
    "runs ahead of the layer's long GEMMs hides them; (2) the transformers experts' own "
    "memory traffic (gathers of the routed rows, silu(gate), its product with up, the "
    "weighting) about 2 ms, which Megatron fuses (permute fusion, fused SwiGLU); (3) 21 "
    "unfused element-wise ops (RMSNorm, rotary, residual adds) 1.4 ms. Q1's EP group spans 4 "
    "nodes: its all-to-alls are priced as 4 per layer and micro-batch of b·s·k/t routed rows "
    "each over InfiniBand (ep_comm), while DeepEP sends a token once per destination node "
    "and forwards it over NVLink, so fewer bytes cross InfiniBand than priced.")
"""Why the predictions are slow, measured on the cost tables of M1
(``autopar.planner.hand_layout.hand_decision`` of its layout, per node kind)."""


def megatron_flops_per_token(cfg: dict, seq: int) -> float:
    """FLOPs per token Megatron-LM logs its TFLOP/s with (``megatron/training/training.py``
    ``transformer_flops`` at NVIDIA/Megatron-LM d98e8a6, l.802-1300, the same for unpacked
    batches at 1e057005 and 6d2a123), for a SwiGLU MoE decoder with every layer MoE, GQA, no
    shared experts: 12·h·1.5·F_e·k per layer for the experts, 6·(h·(q + 2·g·d_h) + q·h) for
    the projections, 6·q·s for the causal attention core (half of s²), 6·h·V for the
    logits (embedding, router, recompute not counted)."""
    h, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim", h // heads)
    q = heads * head_dim
    ffn = cfg.get("moe_intermediate_size", cfg["intermediate_size"])
    k = cfg["num_experts_per_tok"]
    mlp = 12 * h * 1.5 * ffn * k * L
    proj = 6 * L * (h * (q + 2 * kv * head_dim) + q * h)
    core = 6 * L * q * seq
    return mlp + proj + core + 6 * h * cfg["vocab_size"]


def build_model(run: MoERun) -> torch.nn.Module:
    """The run's ``transformers`` causal LM on the meta device."""
    import transformers

    config = transformers.AutoConfig.for_model(run.family, **run.config)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def cluster_for(run: MoERun, matmul_efficiency: float | None = None) -> Cluster:
    """DGX H100 nodes, optionally with another matmul_efficiency (``--fit``)."""
    import dataclasses

    cluster = Cluster.dgx_h100(run.nodes)
    if matmul_efficiency is None:
        return cluster
    device = dataclasses.replace(cluster.device, matmul_efficiency=matmul_efficiency)
    return dataclasses.replace(cluster, device=device)


def evaluate_run(run: MoERun, model=None, matmul_efficiency: float | None = None) -> autopar.Plan:
    """``autopar.evaluate`` of the published layout (its chunks), memory reported, not checked."""
    return autopar.evaluate(model or build_model(run), cluster_for(run, matmul_efficiency),
                            autopar.Layout.parse(run.layout), global_batch_size=run.batch,
                            seq_len=run.seq, model_name=run.name, stage_layers=run.stage_layers,
                            check_memory=False)


def published_step_s(run: MoERun) -> float:
    """The published step seconds: Megatron's FLOPs of the step over its TFLOP/s."""
    gpus = run.nodes * 8
    return megatron_flops_per_token(run.config, run.seq) * run.batch * run.seq / (
        run.published * 1e12 * gpus)


def price(run: MoERun, model=None) -> dict:
    """One row: published and predicted step seconds, Megatron TFLOP/s of the prediction,
    the error of TFLOP/s (published / predicted step − 1), the step's largest parts and
    the memory margin."""
    start = time.perf_counter()
    plan = evaluate_run(run, model)
    pred = plan.predicted
    published = published_step_s(run)
    tflops = run.published * published / pred.step_time_s
    return {"run": run, "published_s": published, "predicted_s": pred.step_time_s,
            "tflops": tflops, "error": published / pred.step_time_s - 1.0,
            "kinds": pred.time_s_by_kind, "margin_gib": pred.memory_margin_bytes / 2**30,
            "peak_gib": pred.peak_memory_bytes / 2**30, "plan": plan,
            "seconds": time.perf_counter() - start}


def fit_efficiency(run: MoERun, lo: float = 0.3, hi: float = 1.0, tol: float = 5e-4) -> float:
    """The H100 matmul_efficiency at which ``run`` predicts its published step (bisection)."""
    model = build_model(run)
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if evaluate_run(run, model, mid).predicted.step_time_s > published_step_s(run):
            lo = mid
        else:
            hi = mid
    return round((lo + hi) / 2, 3)


def markdown(rows: list[dict]) -> str:
    """The report's MoE section (between :data:`SECTION` and :data:`END`)."""
    preds = [r for r in rows if r["run"].role == "prediction"]
    within = sum(abs(r["error"]) <= TOLERANCE for r in preds)
    eff = Cluster.dgx_h100().device.matmul_efficiency
    lines = [SECTION, "",
             "Generated by `python benchmarks/published_moe_runs.py`. Megatron-Core MoE runs "
             "on H100 (NVIDIA's Megatron-MoE-ModelZoo): the published layout priced by "
             "`autopar.evaluate` on `dgx-h100` (expert-TP 1, the EP group spanning TP; ZeRO-1 "
             "with the experts' states over their expert-data-parallel group; memory reported, "
             "not checked), the step time against the published one (Megatron's TFLOP/s count "
             "of the step over its TFLOP/s, `megatron_flops_per_token`), with the preset's "
             f"placeholder matmul_efficiency {eff:g} (no H100 run calibrates it; `--fit` on "
             "M1 reaches the bound 1.0, see below). "
             f"Predictions within {TOLERANCE:.0%}: {within} of {len(preds)}. No row used FP8, "
             "DualPipe or an all-to-all overlapped with compute.", "",
             "| run | GPUs | layout | role | published TFLOP/s | published step s | predicted "
             "step s | predicted TFLOP/s | error | largest parts of the step (s) | peak / margin "
             "GiB | not priced | source |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        run = r["run"]
        top = sorted(((k, v) for k, v in r["kinds"].items() if v > 0), key=lambda kv: -kv[1])[:5]
        lines.append(
            f"| {run.name} | {run.nodes * 8} | {run.layout.replace(',', ' ')} | {run.role} | "
            f"{run.published:.0f} | {r['published_s']:.2f} | {r['predicted_s']:.2f} | "
            f"{r['tflops']:.0f} | {r['error']:+.1%} | "
            + ", ".join(f"{k} {v:.2f}" for k, v in top)
            + f" | {r['peak_gib']:.1f} / {r['margin_gib']:.1f} | "
            f"{'; '.join(run.unpriced) or '—'} | {run.source} |")
    lines += ["", "A negative margin: the layout exceeds the device under autopar's memory model "
              "of the `transformers` program (its experts keep silu(gate), up and their "
              "product; Megatron's fused SwiGLU keeps only the first GEMM's output), which the "
              "published run did not; its time is priced all the same.", "", GAPS, "", END]
    return "\n".join(lines) + "\n"


_SECTION_RE = re.compile(re.escape(SECTION) + r".*?" + re.escape(END) + r"\n?", re.S)


def existing_section(path: Path = REPORT) -> str:
    """The MoE section the report holds now ("" when none): ``published_runs.py`` keeps it
    when it rewrites the dense rows."""
    found = _SECTION_RE.search(path.read_text(encoding="utf-8")) if path.exists() else None
    return found.group(0) if found else ""


def write_section(text: str, path: Path = REPORT) -> None:
    """Replace the MoE section of the report (or append it)."""
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    new = _SECTION_RE.sub(lambda _: text, old) if _SECTION_RE.search(old) else \
        old.rstrip() + "\n\n" + text
    path.write_text(new, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPORT, help="Markdown report to update")
    parser.add_argument("--fit", action="store_true",
                        help="print the H100 matmul_efficiency the calibration row implies")
    args = parser.parse_args(argv)
    if args.fit:
        for run in (r for r in MOE_RUNS if r.role == "calibration"):
            print(f"dgx-h100: matmul_efficiency = {fit_efficiency(run)} (calibrated: {run.name})")
        return 0
    rows = []
    for run in MOE_RUNS:
        rows.append(price(run))
        r = rows[-1]
        print(f"{run.name:34s} published {r['published_s']:6.2f} s predicted "
              f"{r['predicted_s']:6.2f} s  TFLOP/s {run.published:5.0f} vs {r['tflops']:5.0f} "
              f"{r['error']:+7.1%}  margin {r['margin_gib']:6.1f} GiB  ({r['seconds']:.0f} s)",
              flush=True)
    write_section(markdown(rows), args.out)
    print(f"report updated: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
