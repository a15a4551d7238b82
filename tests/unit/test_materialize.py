"""The layout-independent initialisation rule of :mod:`autopar.runtime.materialize`, in one
process: ``init_model`` is a function of (model, seed), the seed of a module is a stable
hash of its name, the rule is the model's own (GPT's ``init_module``, Hugging Face's
``_init_weights`` with its ancestors, torch's ``reset_parameters``), every TP rank's shards
of a meta model (rewritten without processes, ``group=None``) are slices of ``init_model``,
and meta buffers are filled by the rule or refused before any collective. The gloo runs:
tests/multiprocess/test_shard_init.py."""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.graph.capture import trace_model
from autopar.models import GPT, GPTConfig
from autopar.planner.strategies.megatron import megatron_placements
from autopar.rewrite.tensor_parallel import apply_tensor_parallel
from autopar.runtime.materialize import Initializer, module_seed
from autopar.runtime.shard_init import materialize_shards
from helpers import CONFIG, SEQ, load_script


def _meta_gpt(config: GPTConfig = CONFIG) -> GPT:
    with torch.device("meta"):
        return GPT(config)


def test_init_model_depends_on_the_seed_only_and_keeps_ties():
    a, b, c = (autopar.init_model(_meta_gpt(), seed) for seed in (3, 3, 4))
    real = autopar.init_model(GPT(CONFIG), 3)  # a materialised model: as its meta twin
    for other in (b, real):
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                     other.state_dict().values()))
    assert not torch.equal(a.transformer.wte.weight, c.transformer.wte.weight)
    assert a.lm_head.weight is a.transformer.wte.weight and not a.lm_head.weight.is_meta
    std = {k: v.std().item() for k, v in a.named_parameters()}  # GPT-2's rule (init_module)
    assert abs(std["transformer.h.0.mlp.c_fc.weight"] - 0.02) < 2e-3
    assert abs(std["transformer.h.0.mlp.c_proj.weight"] - 0.02 / (2 * CONFIG.n_layer) ** 0.5) < 1e-3
    assert torch.equal(a.transformer.ln_f.weight, torch.ones(CONFIG.n_embd))


def test_module_seed_is_a_stable_hash_of_seed_and_name():
    digest = hashlib.sha256(b"7/transformer.h.0.mlp.c_fc").digest()
    assert module_seed(7, "transformer.h.0.mlp.c_fc") == int.from_bytes(digest[:8], "little") >> 1
    assert module_seed(7, "a") != module_seed(7, "b") != module_seed(8, "b")


def test_reset_parameters_runs_under_the_module_seed():
    """A model without init hooks: each module's reset_parameters, seeded by its name."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 4), nn.LayerNorm(4))
    autopar.init_model(model, seed=11)
    torch.manual_seed(module_seed(11, "0"))
    want = nn.Linear(8, 4)  # reset_parameters in __init__, from the same generator state
    assert torch.equal(model[0].weight, want.weight) and torch.equal(model[0].bias, want.bias)


@pytest.mark.parametrize("tp", [2, 4])
def test_every_tp_rank_of_a_meta_model_holds_slices_of_init_model(tp):
    whole = autopar.init_model(_meta_gpt(), seed=1).state_dict()
    for rank in range(tp):
        traced = trace_model(_meta_gpt(), SEQ)
        tp_rewrite = apply_tensor_parallel(traced, megatron_placements(traced, tp), tp=tp,
                                           tp_rank=rank, group=None)
        gm = tp_rewrite.gm
        shards = {n: tp_rewrite.shards[id(p)] for n, p in gm.named_parameters()}
        assert any(s.dim is not None for s in shards.values())
        materialize_shards(gm, shards, Initializer.of(_meta_gpt(), 1), tp_rank=rank, tp=tp,
                           buffer_keys={})
        for name, p in gm.named_parameters():
            spec = shards[name]
            assert torch.equal(p, spec.local(whole[spec.key], rank, tp)), (tp, rank, name)


class MaskedAttention(nn.Module):
    """nanoGPT's causal mask as a buffer, built where the model is (meta) or on the CPU."""

    def __init__(self, s: int, device: str | None = None) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("bias", torch.tril(torch.ones(s, s, device=device)))


def test_a_meta_buffer_the_rule_does_not_set_is_refused_before_any_collective():
    with torch.device("meta"):
        meta_mask = nn.Sequential(MaskedAttention(8))
        real_mask = nn.Sequential(MaskedAttention(8, device="cpu"))
    with pytest.raises(ValueError, match=r"buffer '0\.bias' of MaskedAttention .*device='cpu'"):
        autopar.init_model(meta_mask)
    from autopar.recipe import parallelize

    with pytest.raises(ValueError, match=r"buffer '0\.bias'"):  # no process group: the
        parallelize(meta_mask, optimizer=torch.optim.SGD)  # error precedes every collective
    model = autopar.init_model(real_mask)  # a real buffer is kept as it is
    assert torch.equal(model[0].bias, torch.tril(torch.ones(8, 8))) and not model[0].proj.weight.is_meta


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.empty(3))


def test_a_parameter_the_rule_leaves_unset_is_named():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), Scale())
    with pytest.raises(ValueError, match=r"parameter '1\.gain' of Scale was not written"):
        autopar.init_model(model)
    model = autopar.init_model(model, init_fn=lambda name, m: nn.init.ones_(m.gain)
                               if isinstance(m, Scale) else m.reset_parameters())
    assert torch.equal(model[1].gain, torch.ones(3))


def test_hugging_face_rules_fill_rotary_buffers_and_scale_gpt2_projections():
    pytest.importorskip("transformers")
    zoo = load_script("benchmarks/model_zoo.py")
    llama = autopar.init_model(zoo.build("llama", "tiny", device="meta"), seed=0)
    real = dict(zoo.build("llama", "tiny").named_buffers())
    for name, buffer in llama.named_buffers():  # inv_freq, original_inv_freq
        assert torch.allclose(buffer, real[name]), name
    gpt2 = autopar.init_model(zoo.build("gpt2", "tiny", device="meta"), seed=0)
    block = gpt2.transformer.h[0]  # GPT2MLP's _init_weights re-draws its child c_proj
    ratio = block.mlp.c_proj.weight.std() / block.mlp.c_fc.weight.std()
    assert abs(ratio - 1 / (2 * gpt2.config.n_layer) ** 0.5) < 0.05
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight


# ---------------------------------------------- model definitions of other stacks (issue 32)
def test_meta_buffers_are_computed_by_the_stacks_own_hooks():
    """litgpt recomputes its rotary cos/sin in ``reset_parameters()``, torchtitan its
    ``freqs_cis`` in ``init_weights(buffer_device)``: a meta model's buffers equal the ones
    the constructor computes on the CPU; litgpt's ``_init_weights`` leaves LayerNorm to the
    module's own ``reset_parameters()`` (ones and zeros)."""
    from stack_models import LitStyleGPT, StackConfig, TitanStyleLlama

    cfg = StackConfig()
    for cls in (LitStyleGPT, TitanStyleLlama):
        with torch.device("meta"):
            meta = cls(cfg)
        model = autopar.init_model(meta, seed=1)
        real = dict(cls(cfg).named_buffers())
        for name, buf in model.named_buffers():
            assert not buf.is_meta and torch.equal(buf, real[name]), (cls.__name__, name)
        assert not any(p.is_meta or p.isnan().any() for p in model.parameters())
    norm = model.layers["0"].attention_norm
    assert torch.equal(norm.weight, torch.ones(cfg.n_embd))
    with torch.device("meta"):
        lit = autopar.init_model(LitStyleGPT(cfg))
    assert torch.equal(lit.transformer.h[0].norm_1.weight, torch.ones(cfg.n_embd))
    assert torch.equal(lit.transformer.h[0].norm_1.bias, torch.zeros(cfg.n_embd))


def test_meta_parameters_keeps_the_constructors_buffers():
    """Built under ``autopar.meta_parameters()`` (as accelerate's ``init_empty_weights``):
    parameters on meta, the buffers the constructor computed real, and init_model gives the
    values of the all-meta model."""
    from stack_models import LitStyleGPT, StackConfig

    cfg = StackConfig()
    with autopar.meta_parameters():
        model = LitStyleGPT(cfg)
    assert all(p.is_meta for p in model.parameters())
    assert not model.cos.is_meta and torch.equal(model.cos, LitStyleGPT(cfg).cos)
    assert not nn.Linear(2, 2).weight.is_meta  # the class is restored afterwards
    with torch.device("meta"):
        meta = LitStyleGPT(cfg)
    want = autopar.init_model(meta, seed=2).state_dict()
    got = autopar.init_model(model, seed=2).state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())


class Unsettable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("table", torch.arange(4.0))

    def init_weights(self) -> None:
        pass  # sets nothing


def test_a_buffer_no_hook_sets_names_what_was_tried():
    with torch.device("meta"):
        model = Unsettable()
    with pytest.raises(ValueError, match=r"buffer 'table' of Unsettable .*the init rule, "
                                         r"init_weights\(\).*meta_parameters"):
        autopar.init_model(model)

