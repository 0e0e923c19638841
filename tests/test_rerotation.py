"""Key re-rotation (``key_rerotation``, ``finch``'s default) against an independent path: the plain model's full
cache of the prompt, each KV head's kept keys turned back to position 0 and forward to 0..C-1 by the model's own
rotary embedding, in a ``DynamicCache``, and the question fed from position C, as kvpress's pipeline feeds it.
kvpress itself is compared on SmolLM2 by ``h2o_eval.benchmarks.kvpress_compare``."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import rotate_half

from h2o_eval import EvictionCache, load_model, make_policy, patch
from h2o_eval.errors import ConfigError

PROMPT, QUESTION = 30, 6


def ids(seed: int) -> torch.Tensor:
    return torch.randint(100, 4000, (1, PROMPT + QUESTION), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def as_kvpress(model, tokens: torch.Tensor, kept: list[list[list[int]]]) -> torch.Tensor:
    """The question's logits after the prompt, each (layer, KV head) holding the ``kept`` positions' keys re-rotated
    to 0..C-1 (the prompt's full keys turned by the model's rotary: back by their positions, on by their ranks),
    the question at positions C.. ."""
    full = DynamicCache(config=model.config)
    model(tokens[:, :PROMPT], cache=full, use_cache=True)
    rotary = model.model.rotary_emb
    cache = DynamicCache(config=model.config)
    for layer, heads in enumerate(kept):
        keys, values = full.layers[layer].keys[0], full.layers[layer].values[0]
        count = len(heads[0])
        turned = []
        for head, positions in enumerate(heads):
            key = keys[head, positions]
            cos, sin = rotary(key, torch.tensor([positions]))
            key = key * cos[0] - rotate_half(key) * sin[0]  # back to position 0
            cos, sin = rotary(key, torch.arange(count).view(1, -1))
            turned.append(key * cos[0] + rotate_half(key) * sin[0])
        held = torch.stack([values[head, positions] for head, positions in enumerate(heads)])
        cache.update(torch.stack(turned).unsqueeze(0), held.unsqueeze(0), layer)
    positions = torch.arange(count, count + QUESTION).view(1, -1)
    return model(tokens[:, PROMPT:], cache=cache, position_ids=positions).logits


@torch.no_grad()
def through_cache(model, policy, tokens: torch.Tensor, protocol: str) -> tuple[torch.Tensor, list]:
    """The question's logits through an EvictionCache that compressed the prompt, and the positions it kept."""
    cache = EvictionCache(model, policy, protocol=protocol)
    model(tokens[:, :PROMPT], cache=cache, use_cache=True)
    kept = [
        [sorted(layer.position[0, h][layer.held[0, h]].tolist()) for h in range(layer.held.shape[1])]
        for layer in cache.layers
    ]
    return model(tokens[:, PROMPT:], cache=cache, use_cache=True).logits, kept


@pytest.mark.parametrize(
    ("family", "turned", "plain", "protocol"),
    [
        ("tiny-llama", ("key_rerotation", {"base": "knorm"}), ("knorm", {}), "context"),  # each KV head its tokens
        (
            "tiny-llama3",  # Llama 3's scaled rotary
            ("key_rerotation", {"base": "snapkv", "window": 4}),
            ("snapkv", {"window": 4}),
            "context",
        ),
        ("tiny-qwen3", ("finch", {"window": 6}), ("finch", {"window": 6, "rerotate_keys": False}), "prefill"),
    ],
)
def test_rerotated_keys_answer_as_the_kept_keys_at_contiguous_positions(family, turned, plain, protocol):
    """C = 12 of 30 prompt tokens, then a 6-token question: the question's logits equal the independent path's (the
    kept keys at 0..C-1, the question from C), the same tokens are kept as without re-rotation, whose logits
    differ."""
    model, _ = load_model(family, device="cpu")
    tokens = ids(11)
    logits, kept = through_cache(model, make_policy(turned[0], 0.4, **turned[1]), tokens, protocol)
    assert {len(head) for layer in kept for head in layer} == {12}
    assert any(head != list(range(18, 30)) for layer in kept for head in layer), "nothing evicted inside the prompt"
    expected = as_kvpress(model, tokens, kept)
    torch.testing.assert_close(logits, expected, atol=2e-5, rtol=0)
    unturned, same = through_cache(model, make_policy(plain[0], 0.4, **plain[1]), tokens, protocol)
    assert same == kept
    assert (unturned - expected).abs().max() > 1e-3, "re-rotation changed nothing: the test proves nothing"


@pytest.mark.parametrize(
    ("family", "refusal"),
    [
        ("tiny-opt", r"^policy 'key_rerotation' re-rotates the kept keys, and opt has no rotary position embedding"),
        ("tiny-phi3", r"^policy 'key_rerotation' re-rotates whole keys, and phi3 rotates only part of each head"),
        ("dynamic", r"^policy 'key_rerotation' re-rotates the kept keys, and llama's rotary type 'dynamic' has no"),
    ],
)
def test_a_rotary_that_cannot_be_turned_again_is_refused(family, refusal):
    if family == "dynamic":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
        )  # fmt: skip
        model = LlamaForCausalLM(config)
    else:
        model, _ = load_model(family, device="cpu")
    with pytest.raises(ConfigError, match=refusal):
        EvictionCache(model, make_policy("key_rerotation", 0.5), protocol="context")


def test_a_prompt_not_fed_alone_is_refused(tmp_path, data_dir):
    """The keys are turned after the prompt's compression: a forward that holds what follows the prompt (patch's,
    a log-likelihood request's) cannot; FINCH without re-rotation can; a base that re-rotates is not wrapped."""
    from conftest import make_config

    from h2o_eval.run import validate

    model, _ = load_model("tiny-llama", device="cpu")
    refused = r"^policy 'finch' re-rotates the keys its prompt kept, so the prompt is fed alone"
    with pytest.raises(ConfigError, match=refused), patch(model, make_policy("finch", 0.5, window=4), "prefill") as run:
        run.context_lengths = [8]
        model(ids(1)[:, :12])
    with patch(model, make_policy("finch", 0.5, window=4, rerotate_keys=False), protocol="prefill") as session:
        session.context_lengths = [8]
        model(ids(1)[:, :12])
    with pytest.raises(ConfigError, match="re-rotates the keys its prompt kept, which a log-likelihood request's"):
        validate(make_config(data_dir, tmp_path, task="copa", policy="key_rerotation", protocol="prefill"))
    with pytest.raises(ConfigError, match=r"^key_rerotation: base='finch' re-rotates its kept keys already"):
        make_policy("key_rerotation", 0.5, base="finch")
    with pytest.raises(ConfigError, match=r"^key_rerotation: base='h2o_reference' computes its own attention"):
        make_policy("key_rerotation", 0.5, base="h2o_reference")
