"""Model registry: names resolve to real models offline; unknown names list the valid ones."""

from __future__ import annotations

import pytest
import torch

from h2o_eval import load_model
from h2o_eval.errors import ConfigError
from h2o_eval.models import registry

TINY = ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-opt", "tiny-gpt-neox", "tiny-gpt2"]


def test_unknown_model_lists_the_registered_names():
    with pytest.raises(ConfigError, match=r"unknown model 'llama-9000'.*smollm2-135m.*tiny-llama"):
        load_model("llama-9000")


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


@pytest.mark.parametrize("name", TINY)
def test_tiny_models_are_deterministic_and_share_the_real_tokenizer(name):
    first, tokenizer = load_model(name, device="cpu")
    second, _ = load_model(name, device="cpu")
    ids = tokenizer("Heavy hitters keep the cache small.", return_tensors="pt").input_ids
    assert first.config.vocab_size == len(tokenizer)
    torch.testing.assert_close(first(ids).logits, second(ids).logits, rtol=0, atol=0)
