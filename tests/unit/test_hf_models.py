"""``hf:CONFIG`` model specs (autopar/hf_models.py through autopar.load_model and the CLI):
published presets whose parameter counts equal the published checkpoints', a local
config.json (file or directory), an architecture's defaults, the error texts, the default
sequence length, and ``autopar plan --model hf:...``. Every model is built on the meta
device (shapes only), so a 70B model costs milliseconds."""

from __future__ import annotations

import json
import sys

import pytest
import torch

pytest.importorskip("transformers")

from autopar import cli  # noqa: E402
from autopar.hf_models import HF_PRESETS  # noqa: E402
from autopar.models import default_seq_len, load_model, model_config  # noqa: E402
from autopar.contract.plan import Plan  # noqa: E402

# Exact counts of the published checkpoints (tied embeddings counted once): GPT-2 124M/355M/
# 774M/1.5B as in openai-community/gpt2*'s safetensors (their num_parameters()), Llama 3 8B
# and 70B as in meta-llama/Meta-Llama-3-{8B,70B} ("8.03B", "70.6B" on the model cards).
PUBLISHED_PARAMS = {"gpt2": 124_439_808, "gpt2-medium": 354_823_168,
                    "gpt2-large": 774_030_080, "gpt2-xl": 1_557_611_200,
                    "llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496,
                    "llama3-405b": 405_853_388_800}  # meta-llama/Llama-3.1-405B's count


def _params(model) -> int:
    """Ψ with shared tensors (a tied lm_head) counted once."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@pytest.fixture
def tiny_llama_dir(tmp_path):
    """A directory holding a tiny Llama's config.json, as save_pretrained writes it."""
    import transformers

    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=128, vocab_size=128,
                                      max_position_embeddings=16)
    config.save_pretrained(tmp_path / "my-llama")
    return tmp_path / "my-llama"


@pytest.mark.parametrize("name", list(PUBLISHED_PARAMS))
def test_preset_has_the_published_parameter_count(name):
    model, spec = load_model(f"hf:{name}")
    assert spec == f"hf:{name}" and all(p.is_meta for p in model.parameters())
    assert _params(model) == PUBLISHED_PARAMS[name]


def test_every_preset_is_counted():
    assert set(HF_PRESETS) == set(PUBLISHED_PARAMS)


def test_llama3_preset_has_the_published_shape():
    """arXiv:2407.21783 Table 3 and the model card's config.json: 8 kv heads (GQA), RoPE
    base 500,000, 8,192 positions, RMSNorm eps 1e-5, untied output layer."""
    model, _ = load_model("hf:llama3-70b")
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.intermediate_size, cfg.vocab_size) == \
        (8192, 80, 64, 8, 28672, 128256)
    assert cfg.rope_parameters["rope_theta"] == 500000.0 and cfg.rms_norm_eps == 1e-5
    assert cfg.max_position_embeddings == 8192 and not cfg.tie_word_embeddings
    assert default_seq_len(model) == 8192


def test_gpt2_preset_wins_over_the_architecture_and_equals_its_defaults():
    import transformers

    model, _ = load_model("hf:gpt2")
    assert type(model).__name__ == "GPT2LMHeadModel" and default_seq_len(model) == 1024
    default = transformers.GPT2Config().to_dict()
    assert all(default[k] == v for k, v in HF_PRESETS["gpt2"][1].items())


def test_architecture_name_builds_its_default_config():
    model, _ = load_model("hf:mistral")
    assert type(model).__name__ == "MistralForCausalLM"
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("as_file", [True, False])
def test_config_json_file_or_directory(tiny_llama_dir, as_file):
    path = tiny_llama_dir / "config.json" if as_file else tiny_llama_dir
    model, spec = load_model(f"hf:{path}", device="cpu", seed=0)
    assert type(model).__name__ == "LlamaForCausalLM" and spec == f"hf:{path}"
    assert model.config.hidden_size == 64 and model.config.num_key_value_heads == 2
    assert default_seq_len(model) == 16
    again, _ = load_model(f"hf:{path}", device="cpu", seed=0)  # seeded: the same weights
    assert all((a == b).all() for a, b in zip(model.parameters(), again.parameters()))


def test_bare_directory_name_is_a_path_only_when_it_holds_config_json(tiny_llama_dir,
                                                                       monkeypatch):
    monkeypatch.chdir(tiny_llama_dir.parent)
    (tiny_llama_dir.parent / "mistral").mkdir()  # a folder named like an architecture
    assert load_model("hf:my-llama")[0].config.hidden_size == 64
    assert type(load_model("hf:mistral")[0]).__name__ == "MistralForCausalLM"


def test_config_stored_dtype_is_ignored(tiny_llama_dir):
    """A config.json saying bfloat16 (Llama 3's does) still builds fp32 weights."""
    path = tiny_llama_dir / "config.json"
    fields = json.loads(path.read_text())
    path.write_text(json.dumps({**fields, "dtype": "bfloat16", "torch_dtype": "bfloat16"}))
    model, _ = load_model(f"hf:{path}")
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_model_config_reads_back_from_a_saved_plan(tiny_llama_dir):
    """An HF config's id2label has int keys; a plan's JSON turns them into strings. The
    recorded model_config is the JSON form, so a saved plan matches its model."""
    import transformers

    model, _ = load_model(f"hf:{tiny_llama_dir}")
    recorded = model_config(model)
    assert json.loads(json.dumps(recorded)) == recorded and "transformers_version" not in recorded
    # the user's own build of the same config.json records the same shape
    config = transformers.AutoConfig.from_pretrained(tiny_llama_dir)
    with torch.device("meta"):
        own = transformers.AutoModelForCausalLM.from_config(config)
    assert model_config(own) == recorded


@pytest.mark.parametrize("spec, cause", [
    ("hf:llama4-2t", "unknown Hugging Face model 'hf:llama4-2t'"),
    ("hf:t5", "'hf:t5' is a T5Config .* no causal-LM head"),
    ("hf:missing/config.json", "cannot read Hugging Face config 'missing/config.json'"),
])
def test_bad_hf_spec_names_the_cause_and_the_fix(spec, cause):
    with pytest.raises(ValueError, match=cause) as info:
        load_model(spec)
    text = str(info.value)
    if "unknown" in text:
        assert all(name in text for name in (*HF_PRESETS, "llama", "gpt_neox", "qwen2"))
        assert "config.json" in text
    elif "T5Config" in text:
        assert "llama" in text


def test_unknown_name_lists_hf_specs_too():
    with pytest.raises(ValueError, match="unknown model 'gpt-nope'") as info:
        load_model("gpt-nope")
    assert "gpt-tiny" in str(info.value) and "hf:CONFIG" in str(info.value)
    assert "llama3-8b" in str(info.value) and "module:factory" in str(info.value)


def test_missing_transformers_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(ValueError, match="need the transformers package.*pip install "
                                         "transformers.*does not depend on torch"):
        load_model("hf:gpt2")


def test_cli_plans_a_config_json(tiny_llama_dir, capsys):
    path = tiny_llama_dir / "config.json"
    assert cli.main(["plan", "--model", f"hf:{path}", "--cluster", "local-cpu",
                     "--global-batch-size", "8", "--tp", "2", "--json"]) == 0
    plan = Plan.from_json(capsys.readouterr().out)
    assert plan.model == f"hf:{path}" and plan.tp == 2
    assert plan.seq_len == 16  # --seq-len defaults to max_position_embeddings


def test_cli_bad_hf_spec_exits_2(capsys):
    assert cli.main(["plan", "--model", "hf:nope", "--cluster", "local-cpu",
                     "--global-batch-size", "8"]) == 2
    err = capsys.readouterr().err
    assert "unknown Hugging Face model 'hf:nope'" in err and "Traceback" not in err
