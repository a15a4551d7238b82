"""autopar.dry_run: ranks of plans at world 64 built and stepped in this one process on
torch's fake process group with fake tensors, compared with the plans' predictions, with a
real (gloo, one process) run of the same program, and with plans edited to be wrong."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.cli.commands import main as cli_main
from autopar.models import GPT, GPTConfig
from autopar.runtime.zero import DistributedOptimizer
from autopar.verify.dry_run import DryRunError, dry_run, place, rank_classes
from cost_models.hardware import Cluster

CLUSTER_64 = Cluster.dgx_a100(8)  # 64 GPUs


def _gpt() -> GPT:
    with torch.device("meta"):
        return GPT(GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=64, vocab_size=256,
                             dropout=0.1))


def _llama():
    import transformers

    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128,
                                      vocab_size=128, max_position_embeddings=64)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def _plan(model, layout: str, batch: int, cluster=CLUSTER_64):
    return autopar.evaluate(model, cluster, autopar.Layout.parse(layout),
                            global_batch_size=batch, seq_len=64)


CASES = {  # name: (model, layout, global batch, cluster)
    "gpt-tp2-pp4-dp8-selective": (_gpt, "tp=2,pp=4,dp=8,mbs=2,zero_stage=1,recompute=selective",
                                  64, CLUSTER_64),
    "llama-tp2-cp2-pp2-dp8": (_llama, "tp=2,cp=2,pp=2,dp=8,mbs=1,zero_stage=1", 16, CLUSTER_64),
    # d = 12: the ZeRO-1 buffer padded to a multiple of d, priced so (1T's plan has d = 12)
    "gpt-tp2-pp2-dp12": (_gpt, "tp=2,pp=2,dp=12,mbs=1,zero_stage=1", 48, Cluster.dgx_a100(6)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_class_at_world_64_moves_the_predicted_bytes(case):
    """One rank per stage, built at world 64 (48): every collective kind's bytes and the model
    states equal the plan's prediction exactly; its groups and layers are the plan's."""
    build, layout, batch, cluster = CASES[case]
    model = build()
    plan = _plan(model, layout, batch, cluster)
    report = dry_run(model, plan)
    block = plan.tp * plan.cp * plan.dp
    assert [c.rank for c in report.checks] == rank_classes(plan) == \
        [s * block for s in range(plan.pp)]
    for c in report.checks:
        assert c.comm_problems() == [], c.comm_problems()
        assert c.measured["model_state_bytes"] == c.predicted["model_state_bytes"] > 0
        assert c.measured["comm_bytes"]["tp_all_reduce"] + \
            c.measured["comm_bytes"]["tp_all_gather"] > 0
        assert c.measured["comm_bytes"]["pp_p2p"] > 0
        assert c.measured["saved_activation_bytes"] > 0
        assert c.peers["tp"] == list(range(c.rank, c.rank + plan.tp))
        assert c.peers["pp"] == [c.rank % block + s * block for s in range(plan.pp)]
        assert c.layers == tuple(range(*plan.stage_layers[c.stage]))
        assert (c.tp_rank, c.cp_rank, c.dp_rank) == (0, 0, 0)
    if plan.cp > 1:
        assert report.checks[0].measured["comm_bytes"]["cp_all_gather"] > 0
        assert report.checks[0].peers["cp"] == [0, plan.tp]
    assert "rank" in report.table() and json.dumps(report.to_dict())


def test_dry_run_measures_what_a_real_process_measures(tmp_path):
    """The second method: the same plan's program on one real gloo process (values,
    storage) saves the same activation bytes and holds the same model states as its dry
    run on fake tensors."""
    model = _gpt()
    plan = _plan(model, "tp=1,pp=1,dp=1,mbs=2,zero_stage=1,recompute=none", 8,
                 cluster=Cluster.local_cpu(1))
    fake = dry_run(model, plan).checks[0].measured
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        pm = autopar.recipe.parallelize(model, plan=plan, optimizer=torch.optim.AdamW)
        idx = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(0))
        for _ in range(2):
            pm.train_step(idx, idx)
        real = pm.last_step_stats()
        pm.groups.destroy()
    finally:
        dist.destroy_process_group()
    assert fake["saved_activation_bytes"] == real["saved_activation_bytes"] > 0
    assert fake["model_state_bytes"] == real["model_state_bytes"] > 0


def test_a_v_placement_with_many_buckets_steps(monkeypatch):
    """A V placement's first rank holds the tied embedding in two chunks, so its gradient
    accumulates twice per micro-batch; with buckets smaller than the embedding (as at full
    size), the bucket readiness once counted it once and raised "accumulated its gradient
    more than m times" (found by the dry run of GPT-3 175B's plan)."""
    monkeypatch.setitem(DistributedOptimizer.__init__.__kwdefaults__, "bucket_bytes", 4096)
    monkeypatch.setitem(DistributedOptimizer.__init__.__kwdefaults__, "first_bucket_bytes", 4096)
    model = _gpt()
    plan = _plan(model, "tp=2,pp=2,dp=16,mbs=1,zero_stage=1,schedule=dualpipe_v,"
                        "virtual_stages=2,sequence_parallel=true", 64)
    report = dry_run(model, plan, ranks=[0])
    assert report.checks[0].layers == (0, 3) and report.checks[0].comm_problems() == []


@pytest.mark.parametrize("edit, names", [
    (dict(stage_layers=[[0, 2], [2, 2], [2, 3], [3, 4]]), "stage_layers[1]"),
    (dict(tp=3), "transformer_wte"),
])
def test_a_plan_edited_to_be_wrong_fails_naming_the_rank_and_the_cause(edit, names):
    model = _gpt()
    plan = dataclasses.replace(_plan(model, "tp=2,pp=4,dp=8,mbs=2,zero_stage=1", 64), **edit)
    with pytest.raises(DryRunError, match=r"rank 16 \(stage \d, tp rank \d, cp rank 0, dp "
                                          r"rank \d\).*" + names.replace("[", r"\[")):
        dry_run(model, plan, ranks=[16])
    assert not dist.is_initialized()


def test_refusals_name_the_cause():
    model = _gpt()
    plan = _plan(model, "tp=2,pp=4,dp=8,mbs=2,zero_stage=1", 64)
    with pytest.raises(ValueError, match="outside the plan's world of 64"):
        dry_run(model, plan, ranks=[64])
    with pytest.raises(ValueError, match="expert parallelism"):
        dry_run(model, dataclasses.replace(plan, ep=2), ranks=[0])
    with pytest.raises(ValueError, match="zero_stage=3"):
        dry_run(model, dataclasses.replace(plan, zero_stage=3), ranks=[0])
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="already initialised"):
            dry_run(model, plan, ranks=[0])
    finally:
        dist.destroy_process_group()


def test_place_follows_megatrons_rank_order():
    plan = _plan(_llama(), "tp=2,cp=2,pp=2,dp=8,mbs=1,zero_stage=1", 16)
    assert place(plan, 0) == {"stage": 0, "tp_rank": 0, "cp_rank": 0, "dp_rank": 0}
    assert place(plan, 1 + 2 + 4 * 3 + 32) == {"stage": 1, "tp_rank": 1, "cp_rank": 1,
                                               "dp_rank": 3}


def test_cli_dryrun_prints_json_and_exits_0(tmp_path, capsys):
    """``autopar dryrun PLAN.json``: the plan's own model rebuilt on meta, every rank class
    (JSON), one rank by --rank (table); a rank outside the world is bad input (exit 2)."""
    model, spec = autopar.load_model("gpt-tiny")
    plan = autopar.evaluate(model, CLUSTER_64, autopar.Layout.parse("tp=2,pp=2,dp=16,mbs=1"),
                            global_batch_size=32, seq_len=16, model_name=spec)
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    assert cli_main(["dryrun", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and [r["rank"] for r in out["ranks"]] == [0, 32]
    assert cli_main(["dryrun", str(path), "--rank", "33"]) == 0
    assert "ok: every rank agrees" in capsys.readouterr().out
    assert cli_main(["dryrun", str(path), "--rank", "64"]) == 2
    assert "[0, 64)" in capsys.readouterr().err
