"""The model zoo: does autopar plan, parallelize and verify the models people bring?

For each family — Hugging Face GPT-2, GPT-NeoX, OPT, Llama, Mistral, Qwen2, Gemma, Phi-3
(``transformers`` configs, random weights, no downloads), autopar's own GPT and the
nanoGPT-style single file ``examples/nanogpt_model.py`` — this script

1. captures a *wide* instance on the meta device (h = 1024, 16 heads, 2 layers, s = 512),
   plans it with tp pinned to 2 on a DGX-A100 node, and checks that the solver's TP
   placements are Megatron's pattern: every Linear that reads the residual stream (QKV,
   MLP-in) split by columns, every Linear that reads another Linear of its layer
   (attention-out, MLP-out) split by rows;
2. verifies a *tiny* instance (2 layers, h = 64, s = 16, fp32) against one process at
   each layout of :data:`LAYOUTS` (gloo, real process groups), with sequence parallelism
   and selective recompute where TP is on;

and writes ``reports/model_zoo.md``: one row per family, with the op that stopped it
where one did, keeping the report's section on every other family. Run: ``python benchmarks/model_zoo.py`` (about 30 minutes on 2 cores;
``--no-verify`` for the planning half only, seconds per family).

``--all`` instead walks every causal-LM family ``transformers`` ships
(:mod:`benchmarks.hf_families`: decoder-only dense, MoE, or out of scope with the reason),
verifies Megatron-LM's tp2 layout of each at the tiny size from its config's defaults, and
rewrites only the report's section on them (about 20 s per family; ``--groups dense`` for
the dense ones).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

LAYOUTS = {"tp2": dict(tp=2, pp=1, dp=1), "pp2": dict(tp=1, pp=2, dp=1),
           "dp2": dict(tp=1, pp=1, dp=2), "tp2·pp2": dict(tp=2, pp=2, dp=1),
           "pp2·v2": dict(tp=1, pp=2, dp=1, schedule="interleaved_1f1b", virtual_stages=2),
           "dp2 zero3 bf16": dict(tp=1, pp=1, dp=2, zero_stage=3, dtype="bf16")}
TINY = dict(hidden=64, heads=4, kv_heads=2, ffn=128, layers=2, vocab=128, positions=64)
WIDE = dict(hidden=1024, heads=16, kv_heads=8, ffn=4096, layers=2, vocab=32000, positions=512)
TINY_SEQ, WIDE_SEQ, BATCH = 16, 512, 8


def _hf(name: str, d: dict):
    import transformers as tf

    h, a, kv, f, L, V, P = (d[k] for k in ("hidden", "heads", "kv_heads", "ffn", "layers",
                                            "vocab", "positions"))
    if name == "gpt2":
        cfg = tf.GPT2Config(n_embd=h, n_head=a, n_layer=L, vocab_size=V, n_positions=P,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return tf.GPT2LMHeadModel(cfg)
    if name == "gpt_neox":
        cfg = tf.GPTNeoXConfig(hidden_size=h, num_attention_heads=a, num_hidden_layers=L,
                               intermediate_size=f, vocab_size=V, max_position_embeddings=P,
                               hidden_dropout=0.0, attention_dropout=0.0)
        return tf.GPTNeoXForCausalLM(cfg)
    if name == "opt":
        cfg = tf.OPTConfig(hidden_size=h, num_attention_heads=a, num_hidden_layers=L, ffn_dim=f,
                           vocab_size=V, max_position_embeddings=P, word_embed_proj_dim=h,
                           dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
        return tf.OPTForCausalLM(cfg)
    common = dict(hidden_size=h, num_attention_heads=a, num_key_value_heads=kv,
                  num_hidden_layers=L, intermediate_size=f, vocab_size=V,
                  max_position_embeddings=P)
    classes = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
               "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
               "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
               "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM),
               "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM)}
    config_cls, model_cls = classes[name]
    if name == "gemma":
        common["head_dim"] = h // a
    if name == "phi3":
        common["pad_token_id"] = 0
    return model_cls(config_cls(**common))


def _autopar_gpt(d: dict):
    from autopar.models import GPT, GPTConfig

    return GPT(GPTConfig(n_layer=d["layers"], n_head=d["heads"], n_embd=d["hidden"],
                         vocab_size=d["vocab"], block_size=d["positions"]))


def _nanogpt(d: dict):
    from examples.nanogpt_model import GPT, GPTConfig

    return GPT(GPTConfig(block_size=d["positions"], vocab_size=d["vocab"], n_layer=d["layers"],
                         n_head=d["heads"], n_embd=d["hidden"]))


FAMILIES = ["gpt2", "gpt_neox", "opt", "llama", "mistral", "qwen2", "gemma", "phi3",
            "autopar-gpt", "nanogpt"]


def build(family: str, size: str = "tiny", device: str = "cpu", seed: int = 0,
          layers: int | None = None) -> torch.nn.Module:
    """A ``family`` model of ``size`` "tiny" (verification) or "wide" (planning), seeded;
    ``layers`` overrides the size's depth (2). A family outside :data:`FAMILIES` is any
    causal-LM model type of transformers (:func:`benchmarks.hf_families.build_family`)."""
    d = dict(TINY if size == "tiny" else WIDE)
    d["layers"] = layers or d["layers"]
    if family not in FAMILIES:  # any other causal-LM family of transformers, as --all builds it
        from benchmarks.hf_families import build_family

        return build_family(family, device=device, d=d, seed=seed)
    torch.manual_seed(seed)
    with torch.device(device):
        if family == "autopar-gpt":
            return _autopar_gpt(d)
        if family == "nanogpt":
            return _nanogpt(d)
        return _hf(family, d)


def megatron_pattern(traced, placements: dict[str, str]) -> list[str]:
    """The Linears whose placement breaks Megatron's pattern ("in" by columns, "out" by
    rows, an MoE router whole); empty when the plan follows it."""
    from autopar.planner.strategies.megatron import linear_roles, moe_routers

    routers = moe_routers(traced)
    want = {"in": "column", "out": "row"}
    roles = {name: "router" if name in routers else role
             for name, role in linear_roles(traced).items()}
    return [f"{name} ({role}: {placements[name].split(':')[0]})"
            for name, role in roles.items()
            if placements[name].split(":")[0] != want.get(role, "replicate")]


def plan_wide(family: str) -> dict:
    """Capture and plan the wide instance at tp = 2 on one DGX-A100 node (8 GPUs)."""
    import autopar
    from autopar.graph.capture import trace_model
    from cost_models.hardware import Cluster

    model = build(family, "wide", device="meta")
    t0 = time.perf_counter()
    traced = trace_model(model, WIDE_SEQ)
    plan = autopar.plan(model, Cluster.dgx_a100(1), global_batch_size=BATCH, seq_len=WIDE_SEQ,
                        layout=autopar.Layout(tp=2, pp=1, dp=4, micro_batch_size=1),
                        model_name=family)
    seconds = time.perf_counter() - t0
    return {"plan_s": seconds, "broken": megatron_pattern(traced, plan.placements),
            "linears": sum(i.kind == "linear" for i in traced.nodes.values()), "nodes": len(traced.nodes),
            "params": traced.total_params()}


def _layers(layout: dict) -> int:
    """Depth of the tiny instance for ``layout``: 2, or 2 per model chunk (interleaved)."""
    return 2 * layout.get("virtual_stages", 1)


def tiny_plan(family: str, layout: dict):
    """A plan of the tiny instance for ``layout`` (Layout fields; fp32 unless it names a
    dtype) on a fast local cluster; TP layouts with SP and selective recompute."""
    import autopar
    from cost_models.hardware import Cluster, LinkSpec

    world = layout["tp"] * layout["pp"] * layout["dp"] * layout.get("cp", 1)
    a100 = Cluster.dgx_a100(1)
    fast = LinkSpec(name="ideal", bandwidth_gbps=1e6, latency_s=1e-12, source="model zoo")
    cluster = Cluster(device=a100.device, gpus_per_node=world, nodes=1, intra_node=fast,
                      inter_node=fast, name="zoo", dtype="fp32", attention="flash")
    extra = dict(sequence_parallel=True, recompute="selective") if layout["tp"] > 1 else {}
    return autopar.plan(build(family, "tiny", device="meta", layers=_layers(layout)), cluster,
                        global_batch_size=BATCH, seq_len=TINY_SEQ, model_name=family,
                        layout=autopar.Layout(**{"dtype": "fp32", **extra, **layout}))


def _verify_rank(rank: int, world: int, family: str, plan) -> dict:
    from autopar.verify.check import verify

    return verify(build(family, "tiny", layers=plan.stage_layers[-1][1]), plan).to_dict()


def verify_tiny(family: str, name: str) -> str:
    """"ok (max grad diff …)" or the first line of the error that stopped ``family``."""
    from autopar.runtime.launch import launch
    from benchmarks.model_zoo import _verify_rank  # importable by the spawned ranks

    layout = LAYOUTS[name]
    try:
        plan = tiny_plan(family, layout)
        report = launch(_verify_rank, layout["tp"] * layout["pp"] * layout["dp"], family, plan,
                        timeout_s=300, pg_timeout_s=60)[0]
    except Exception as exc:  # the row records what stopped the family
        return "stopped: " + _first_line(exc)
    return f"ok ({report['max_grad_diff']:.1e})" if report["ok"] else "MISMATCH"


def bf16_drift(family: str, steps: int = 3) -> list[float]:
    """Per SGD step (lr 0.1, verify's batches' shape), the largest relative gradient
    difference between the tiny ``family`` model in bf16 (fp32 master weights, two
    data-parallel halves averaged) and in fp32, with plain PyTorch on one process: the
    part of a bf16 layout's difference under ``verify`` that is bf16's, not autopar's."""
    import copy

    import torch.nn.functional as F

    from autopar.graph.export import causal_lm_logits

    m32 = build(family, "tiny")
    m16 = copy.deepcopy(m32).to(torch.bfloat16)
    master = [p.detach().float().clone() for p in m16.parameters()]
    sgd = torch.optim.SGD(m32.parameters(), lr=0.1)
    gen, drift = torch.Generator().manual_seed(0), []
    for _ in range(steps):
        idx, targets = (torch.randint(0, TINY["vocab"], (BATCH, TINY_SEQ), generator=gen)
                        for _ in range(2))

        def loss(model, rows):
            logits = causal_lm_logits(model, idx[rows]).float()
            return F.cross_entropy(logits.flatten(0, 1), targets[rows].flatten())

        m32.zero_grad()
        loss(m32, slice(None)).backward()
        m16.zero_grad()
        for rows in (slice(0, BATCH // 2), slice(BATCH // 2, None)):
            (loss(m16, rows) / 2).backward()
        drift.append(max((p16.grad.float() - p32.grad).norm().item()
                         / max(p32.grad.norm().item(), 1e-3)
                         for p32, p16 in zip(m32.parameters(), m16.parameters())))
        sgd.step()
        with torch.no_grad():
            for w, p in zip(master, m16.parameters()):
                w -= 0.1 * p.grad.float()
                p.copy_(w)
    return drift


def bf16_notes(families: list[str]) -> list[str]:
    """Report lines for the families whose bf16 layout failed: their :func:`bf16_drift`."""
    if not families:
        return []
    lines = ["", "## bf16 rows that fail", "",
             "verify compares a bf16 layout with the fp32 model (tolerance 5e-2 relative). "
             "The same model in bf16 with plain PyTorch on one process (fp32 master weights, "
             "two data-parallel halves; `bf16_drift`) already differs from fp32 by, per step:", ""]
    for family in families:
        drift = ", ".join(f"{d:.1e}" for d in bf16_drift(family))
        lines.append(f"- {family}: {drift}")
    return lines


def _first_line(exc: BaseException) -> str:
    """The error's diagnosis in one table cell: its last line naming an error, else its
    first line, and where it happened (autopar's "at FILE:LINE" line) when it says."""
    text = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    named = [line for line in text if "Error" in line and not line.startswith("fix:")]
    lines = named[-1:] or text[:1] or [type(exc).__name__]
    at = next((line for line in text if line.startswith("at ") and ":" in line), None)
    where = ""
    if at is not None:  # "at /path/modeling_x.py:915 in forward: `code`" -> modeling_x.py:915
        where = f" (at {at[3:].split(' in ')[0].rsplit('/', 1)[-1]})"
    return (lines[-1][:160 - len(where)] + where).replace("|", "/")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-verify", action="store_true", help="planning only")
    parser.add_argument("--families", nargs="*", default=FAMILIES)
    parser.add_argument("--out", default=str(ROOT / "reports" / "model_zoo.md"))
    parser.add_argument("--all", action="store_true",
                        help="every causal-LM family of transformers at tp2 instead "
                             "(benchmarks/hf_families.py); rewrites only that section")
    parser.add_argument("--groups", nargs="*", default=["dense", "moe", "hybrid"],
                        help="with --all: the groups to verify")
    parser.add_argument("--retry", action="store_true",
                        help="with --all: keep the report's rows that verified, run the rest")
    args = parser.parse_args(argv)
    if args.all:
        from benchmarks.hf_families import all_families_section, earlier_rows, write_section

        keep = earlier_rows(args.out) if args.retry or args.no_verify else {}
        write_section(args.out, all_families_section(args.groups, keep=keep,
                                                     run=not args.no_verify))
        print(f"wrote {args.out}")
        return
    import transformers

    rows = []
    for family in args.families:
        try:
            wide = plan_wide(family)
            pattern = "Megatron" if not wide["broken"] else "differs: " + ", ".join(wide["broken"][:3])
            planned = f"{wide['plan_s']:.1f} s, {wide['nodes']} nodes"
        except Exception as exc:
            pattern, planned = "—", "stopped: " + _first_line(exc)
        cells = [] if args.no_verify else [verify_tiny(family, name) for name in LAYOUTS]
        rows.append((family, planned, pattern, *cells))
        print(" | ".join(rows[-1]), flush=True)
    head = ["family", "capture + plan (wide, tp=2, 8×A100)", "TP placements"]
    head += [] if args.no_verify else [f"verify {name}" for name in LAYOUTS]
    table = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines = ["# Model zoo", "",
             f"`python benchmarks/model_zoo.py` (torch {torch.__version__}, transformers "
             f"{transformers.__version__}). Wide: h = {WIDE['hidden']}, {WIDE['heads']} heads "
             f"({WIDE['kv_heads']} kv where the family has GQA), s = {WIDE_SEQ}, meta device. "
             f"Tiny: h = {TINY['hidden']}, s = {TINY_SEQ}, fp32 unless named, 3 SGD steps "
             "against one process (max relative gradient difference); TP layouts with "
             "sequence parallelism and selective recompute; pp2·v2: the interleaved "
             "schedule on 4 layers.", "", *table]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines += bf16_notes([row[0] for row in rows if any(
        "bf16" in name and not cell.startswith(("ok", "not run"))
        for name, cell in zip(LAYOUTS, row[3:]))])
    from benchmarks.hf_families import MARKER

    out = Path(args.out)
    kept = MARKER + out.read_text().split(MARKER)[1] if out.exists() and MARKER in out.read_text() else ""
    out.write_text("\n".join(lines) + "\n" + ("\n" + kept if kept else ""))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
