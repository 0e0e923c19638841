"""The backend on real (tiny) transformers models: each protocol against an independent path."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import FAST_POLICIES, TINY, fast_sample, registered

from h2o_eval import EvictionCache, load_model, make_policy, patch
from h2o_eval.errors import ConfigError
from h2o_eval.generation import settle
from h2o_eval.policies import POLICIES, Policy, example_policy

FAMILIES = TINY
# The generic suites take every registered policy its class allows (conftest.registered), with its example
# parameters; the family coverage below runs two policies of different kinds on every other family.
EVICTING = registered("simulate", evicting=True)
# Policies that exist only in the prompt-compressing protocols (prefill, context), as their classes declare.
PROMPT_ONLY = [name for name in registered("prefill") if "simulate" not in POLICIES[name].protocols]


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = load_model(name, device="cpu")[0]
        return cache[name]

    return get


def tokens(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(100, 40000, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def step_by_step(model, ids, cache, first: int = 1) -> torch.Tensor:
    """Feed ``ids[:, :first]`` as one chunk, then one token at a time, through ``cache``."""
    logits = [model(ids[:, :first], cache=cache, use_cache=True).logits]
    for i in range(first, ids.shape[1]):
        logits.append(model(ids[:, i : i + 1], cache=cache, use_cache=True).logits)
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize("family", fast_sample(FAMILIES, lambda family: family in ("tiny-llama", "tiny-gemma3")))
def test_full_and_whole_sequence_budgets_reproduce_the_unpatched_model(models, family):
    model = models(family)
    ids = tokens(2, 24)
    with torch.no_grad():
        plain = model(ids).logits
        for name, cls in POLICIES.items():
            one_forward = not (example_policy(name).rehearses or example_policy(name).rerotates)
            for protocol in cls.protocols if one_forward else ():  # patch: one forward
                # A cache of the whole sequence evicts nothing. The authors' simulation (no cache) keeps
                # int(0.5 T) - 1 heavy keys that may overlap its recent band: at a budget of the whole sequence it
                # can still drop old keys (it does on Qwen3 and Gemma 3); beyond it, it cannot. A policy that grows
                # after its prompt keeps the 8 tokens after a 16-token context; one that evicts needs it all.
                budgets = (1.0, 24, 100) if example_policy(name).has_cache else (100,)
                context = 16 if example_policy(name).rule.grows else 24
                for budget in budgets:
                    with patch(model, example_policy(name, budget), protocol=protocol) as session:
                        session.context_lengths = [context, context]
                        patched = model(ids).logits
                    assert (patched - plain).abs().max() <= 1e-5, (name, protocol, budget)
        assert torch.equal(model(ids).logits, plain), "the model changed after patch() exited"


def held_slots(layer) -> int:
    """What a layer of the EvictionCache holds: C for a compressed layer, window - 1 for a sliding one."""
    return layer.keys.shape[2]


@pytest.mark.parametrize(
    ("family", "name", "kernels"),
    fast_sample(
        [("tiny-llama", name, kernels) for name in EVICTING for kernels in ("auto", "torch")]
        + [("tiny-opt", name, kernels) for name in EVICTING for kernels in ("auto", "torch")]
        + [(family, name, "auto") for family in FAMILIES[1:] if family != "tiny-opt" for name in ("h2o", "streaming")],
        lambda case: case[0] == "tiny-llama" and case[1] in FAST_POLICIES and case[2] == "auto",
    ),
)
def test_simulate_equals_token_by_token_eviction_cache(models, family, name, kernels):
    """Reference: EvictionCache fed one token at a time from empty (a cache that really holds C entries);
    implementation: patch(simulate), one forward over the whole sequence. 64 tokens at budget 0.2: C = 13,
    51 evictions per KV head and layer (every policy on Llama and OPT, H2O and StreamingLLM on every other
    family); Gemma 3's sliding layers hold their last 7 tokens, its global layer C."""
    model = models(family)
    ids = tokens(2, 64, seed=1)
    policy = example_policy(name, 0.2)
    with torch.no_grad(), patch(model, policy, kernels=kernels):
        simulated = model(ids).logits
    cache = EvictionCache(model, policy, length=64, kernels=kernels)
    stepped = step_by_step(model, ids, cache)
    assert (simulated - stepped).abs().max() <= 1e-4
    expected = [13 if layer.window is None else layer.window - 1 for layer in cache.layers]
    assert [held_slots(layer) for layer in cache.layers] == expected
    assert (simulated - model(ids).logits).abs().max() > 1e-2, "eviction changed nothing: the test proves nothing"


@pytest.mark.parametrize(
    ("family", "name", "protocol"),
    fast_sample(
        [
            (family, name, protocol)
            for family in ("tiny-llama", "tiny-opt")
            for name in registered("prefill", evicting=True, passes=False)
            for protocol in ("prefill", "context")
            if protocol in POLICIES[name].protocols
        ]
        + [
            (family, name, "prefill")
            for family in FAMILIES
            if family not in ("tiny-llama", "tiny-opt")
            for name in ("h2o", "snapkv")
        ],
        lambda case: case[0] in ("tiny-llama", "tiny-gemma3") and case[1] in FAST_POLICIES,
    ),
)
def test_prefill_protocol_equals_prefill_compress_then_decode(models, family, name, protocol):
    """Reference: EvictionCache(protocol="prefill") fed the 40-token context as one chunk, then one token at a
    time; implementation: patch(prefill), one forward with the context length set. Budget 0.25 of the context:
    C = 10, so the continuation's 24 tokens each evict one (or, for policies that grow, are all kept)."""
    model = models(family)
    ids = tokens(1, 64, seed=2)
    policy = example_policy(name, 0.25)
    with torch.no_grad(), patch(model, policy, protocol=protocol) as session:
        session.context_lengths = [40]
        one_pass = model(ids).logits
    cache = EvictionCache(model, policy, protocol=protocol)
    stepped = step_by_step(model, ids, cache, first=40)
    assert (one_pass - stepped).abs().max() <= 1e-4
    with torch.no_grad():
        torch.testing.assert_close(one_pass[:, :40], model(ids[:, :40]).logits, atol=1e-5, rtol=0)


@torch.no_grad()
def test_prefill_compression_keeps_protected_and_top_column_sums(models):
    """Independent path: the unpatched model's own attention weights (eager, output_attentions) give the column
    sums; the EvictionCache must hold exactly the recent window plus the top heavy hitters by those sums."""
    model = models("tiny-llama")
    ids = tokens(1, 30, seed=3)
    policy = make_policy("h2o", budget=0.4)  # C = 12: 6 recent + 6 heavy
    cache = EvictionCache(model, policy, protocol="prefill")
    model(ids, cache=cache, use_cache=True)
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    attentions = model(ids, output_attentions=True).attentions
    model.set_attn_implementation(previous)
    for layer, weights in enumerate(attentions):
        column_sums = weights[0].view(2, 2, 30, 30).sum(dim=(1, 2))  # [KV heads, keys]: group and rows summed
        for head in range(2):
            heavy = column_sums[head, :24].topk(6).indices.tolist()
            expected = sorted(heavy + list(range(24, 30)))
            held = cache.layers[layer].position[0, head][cache.layers[layer].held[0, head]]
            assert sorted(held.tolist()) == expected


@pytest.mark.parametrize("name", EVICTING)
def test_cache_never_exceeds_capacity_and_keeps_protected_tokens(models, name):
    model = models("tiny-llama")
    policy = example_policy(name, 10)
    plan = policy.plan(48)
    cache = EvictionCache(model, policy)
    ids = tokens(2, 48, seed=4)
    with torch.no_grad():
        for step in range(48):
            model(ids[:, step : step + 1], cache=cache, use_cache=True)
            for layer in cache.layers:
                held = layer.held.sum(-1)
                assert (held == min(step + 1, plan.capacity)).all()
                assert layer.keys.shape[2] <= plan.capacity
                positions = [set(layer.position[b, h][layer.held[b, h]].tolist()) for b in range(2) for h in range(2)]
                protected = set(range(max(0, step + 1 - plan.recent), step + 1)) | set(range(min(plan.sinks, step)))
                assert all(protected <= p for p in positions)
    assert cache.kv_bytes() == 2 * 2 * 2 * 10 * 16 * 4 * 2  # layers * batch * KV heads * C * head dim * fp32 * (K, V)


@pytest.mark.parametrize(
    ("family", "name", "protocol"),
    [
        ("tiny-llama", name, protocol)
        for name in dict.fromkeys(
            registered("prefill", evicting=True, passes=False) + registered("simulate", cache=False, evicting=True)
        )
        for protocol in ("simulate", "prefill")
        if protocol in POLICIES[name].protocols
    ]
    + [(family, "h2o", protocol) for family in FAMILIES[1:] for protocol in ("simulate", "prefill")],
)
def test_right_padded_batch_equals_each_sequence_alone(models, family, name, protocol):
    model = models(family)
    lengths, contexts = [40, 27, 33], [30, 20, 9]
    ids = tokens(3, 40, seed=5)
    mask = torch.arange(40).expand(3, 40) < torch.tensor(lengths).unsqueeze(1)
    policy = example_policy(name, 0.3)
    with torch.no_grad(), patch(model, policy, protocol=protocol) as session:
        session.context_lengths = contexts
        batched = model(ids, attention_mask=mask.long()).logits
        for i, n in enumerate(lengths):
            session.context_lengths = [contexts[i]]
            alone = model(ids[i : i + 1, :n]).logits
            assert (batched[i, :n] - alone[0]).abs().max() <= 1e-4, i


@torch.no_grad()
def test_heavy_ratio_extremes_are_local_and_heavy(models):
    model = models("tiny-opt")
    ids = tokens(2, 40, seed=6)
    results = {}
    for key, name, params in [
        ("h2o0", "h2o", {"heavy_ratio": 0.0}),
        ("local", "local", {}),
        ("h2o1", "h2o", {"heavy_ratio": 1.0}),
        ("heavy", "heavy", {}),
    ]:
        with patch(model, make_policy(name, budget=0.25, **params)):
            results[key] = model(ids).logits
    torch.testing.assert_close(results["h2o0"], results["local"], rtol=0, atol=1e-6)
    torch.testing.assert_close(results["h2o1"], results["heavy"], rtol=0, atol=1e-6)
    assert (results["local"] - results["heavy"]).abs().max() > 1e-3


@torch.no_grad()
def test_tiny_sequences_and_tiny_budgets_run(models):
    model = models("tiny-llama")
    for length in (1, 2, 3):
        ids = tokens(1, length)
        with patch(model, make_policy("h2o", budget=0.05)) as session:
            out = model(ids).logits
        assert torch.isfinite(out).all()
        assert (session.capacity.lengths[-1], session.capacity.layers[-1]) == (length, [1, 1])


def random_model(model_type: str, **params):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=100, **params)
    return AutoModelForCausalLM.from_config(config)


SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}


@pytest.mark.parametrize(
    ("model_type", "params", "reason"),
    [
        (
            "bloom",
            {"hidden_size": 32, "n_layer": 1, "n_head": 2},
            "does not go through transformers' AttentionInterface",
        ),
        ("gemma2", {**SMALL, "num_key_value_heads": 1, "head_dim": 16}, "soft-caps attention logits"),
        (
            "qwen3_next",
            {
                **SMALL,
                "num_key_value_heads": 1,
                "head_dim": 16,
                "layer_types": ["linear_attention", "full_attention"],
                "num_experts": 2,
                "num_experts_per_tok": 1,
                "moe_intermediate_size": 16,
                "shared_expert_intermediate_size": 16,
                "linear_num_value_heads": 2,
                "linear_num_key_heads": 1,
                "linear_key_head_dim": 8,
                "linear_value_head_dim": 8,
            },
            "its linear_attention layers hold no softmax KV cache",
        ),
    ],
)
def test_models_that_cannot_be_evicted_are_refused_in_one_line(model_type, params, reason):
    """Not a name list: what the model's attention does decides (the interface, soft-capping, layer kinds)."""
    model = random_model(model_type, **params)
    message = rf"^model type '{model_type}' cannot be patched for KV eviction: .*{reason}.*; use [^\n]*$"
    with pytest.raises(ConfigError, match=message), patch(model, make_policy("h2o")):
        pass
    with pytest.raises(ConfigError, match=message):
        EvictionCache(model, make_policy("h2o", budget=8))


@torch.no_grad()
def test_a_window_on_every_layer_bounds_the_sequence(models):
    """Mistral-style: every layer slides, so the policy compresses every layer, and a sequence longer than the
    window (which eviction inside a window would need) is refused rather than run without the window."""
    model = random_model("mistral", **SMALL, num_key_value_heads=1, sliding_window=16)
    policy = make_policy("h2o", budget=0.5)
    with patch(model, policy) as session:
        model(tokens(1, 16, seed=10) % 100)
        assert session.capacity_stats()["layer_capacity_mean"] == [8, 8]
        with pytest.raises(ConfigError, match=r"^a sequence of 17 tokens is longer than the sliding window \(16\)"):
            model(tokens(1, 17, seed=10) % 100)
    cache = EvictionCache(model, make_policy("h2o", budget=8))
    step_by_step(model, tokens(1, 16, seed=10) % 100, cache)
    with pytest.raises(ConfigError, match="longer than the sliding window"):
        model(tokens(1, 1) % 100, cache=cache, use_cache=True)


@torch.no_grad()
def test_sliding_layers_keep_their_own_window_and_count_as_they_are(models):
    """tiny-gemma3: sliding (window 8), global, sliding. Under H2O at C = 13 of 64 tokens, the first sliding
    layer's output is the unpatched model's own (its window untouched), the global layer's is not; the capacity
    statistics and the EvictionCache count each layer as it is: 8 (the window), 13, 8; the cache physically
    holds 7 slots in a sliding layer between steps (transformers' own sliding cache) and 13 in the global one."""
    model = models("tiny-gemma3")
    ids = tokens(2, 64, seed=11)
    policy = make_policy("h2o", budget=0.2)
    plain = model(ids, output_hidden_states=True).hidden_states
    with patch(model, policy) as session:
        patched = model(ids, output_hidden_states=True).hidden_states
    assert torch.equal(patched[1], plain[1])
    assert (patched[2] - plain[2]).abs().max() > 1e-3
    assert session.capacity_stats()["layer_capacity_mean"] == [8, 13, 8]
    cache = EvictionCache(model, policy, length=64)
    step_by_step(model, ids, cache)
    assert [layer.keys.shape[2] for layer in cache.layers] == [7, 13, 7]
    assert cache.capacity().tolist() == pytest.approx([29 / 3, 29 / 3])
    assert cache.kv_bytes() == (7 + 13 + 7) * 2 * 1 * 16 * 4 * 2  # slots * batch * KV heads * head dim * fp32 * (K, V)


def test_a_layer_that_bypasses_the_backend_fails_the_forward(models, monkeypatch):
    model = models("tiny-llama")
    attention = model.model.layers[1].self_attn
    plain_forward = type(attention).forward

    def bypass(self, *args, **kwargs):  # what a model with hard-coded attention does
        previous = self.config._attn_implementation
        self.config._attn_implementation = "sdpa"
        try:
            return plain_forward(self, *args, **kwargs)
        finally:
            self.config._attn_implementation = previous

    monkeypatch.setattr(attention, "forward", bypass.__get__(attention))
    with (
        pytest.raises(RuntimeError, match=r"layers \[1\] did not run through the h2o_eval attention backend"),
        torch.no_grad(),
        patch(model, make_policy("h2o")),
    ):
        model(tokens(1, 12))


def test_h2o_reference_is_simulate_only(models):
    with (
        pytest.raises(ConfigError, match="only in the simulate protocol"),
        patch(models("tiny-llama"), make_policy("h2o_reference"), protocol="prefill"),
    ):
        pass
    with pytest.raises(ConfigError, match="exists only as a simulation"):
        EvictionCache(models("tiny-llama"), make_policy("h2o_reference"))


@pytest.mark.parametrize("name", PROMPT_ONLY)
def test_prompt_compressing_policies_refuse_simulate_in_one_line(models, name):
    model = models("tiny-llama")
    with (
        pytest.raises(ConfigError, match=rf"^policy '{name}' exists only in the prefill and context protocols: use "),
        patch(model, example_policy(name), protocol="simulate"),
    ):
        pass
    with pytest.raises(ConfigError, match="exists only in the prefill and context protocols"):
        EvictionCache(model, example_policy(name, budget=8))


def eager_attentions(model, ids):
    """The unpatched model's own attention probabilities, per layer [B, Hq, T, T] (eager, output_attentions)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        return model(ids, output_attentions=True).attentions
    finally:
        model.set_attn_implementation(previous)


@torch.no_grad()
@pytest.mark.parametrize("pooling", ["max", "avg"])
def test_snapkv_keeps_the_window_and_the_top_pooled_window_votes(models, pooling):
    """Independent path: the unpatched model's eager attention; the last 6 rows' probabilities summed over rows
    and the KV head's query heads, pooled with torch's own max_pool1d / avg_pool1d over the positions before the
    window, top 6 by (score, position). The EvictionCache after the prompt must hold exactly those plus the window."""
    model = models("tiny-llama")
    ids = tokens(1, 40, seed=7)
    policy = make_policy("snapkv", budget=12, window=6, kernel_size=5, pooling=pooling)
    cache = EvictionCache(model, policy, protocol="prefill")
    model(ids, cache=cache, use_cache=True)
    pool = torch.nn.functional.max_pool1d if pooling == "max" else torch.nn.functional.avg_pool1d
    for layer, weights in enumerate(eager_attentions(model, ids)):
        votes = weights[0, :, -6:, :34].view(2, 2, 6, 34).sum(dim=(1, 2))  # [KV heads, positions before the window]
        pooled = pool(votes.unsqueeze(1), 5, stride=1, padding=2).squeeze(1)
        for head in range(2):
            ranked = sorted(range(34), key=lambda j: (-float(pooled[head, j]), -j))
            expected = sorted(ranked[:6] + list(range(34, 40)))
            held = cache.layers[layer].position[0, head][cache.layers[layer].held[0, head]]
            assert sorted(held.tolist()) == expected


@torch.no_grad()
@pytest.mark.parametrize(("recent_ratio", "recent"), [(0.0, 0), (0.5, 5)])
def test_knorm_keeps_the_smallest_key_norms_and_its_recent_window(models, recent_ratio, recent):
    """Independent path: the keys a plain transformers DynamicCache holds after the unpatched prompt (post-RoPE,
    as the attention sees them); knorm at C = 10 keeps the 10 smallest-norm keys (kvpress's rule, the default),
    or with recent_ratio 0.5 the 5 recent tokens plus the 5 smallest-norm others."""
    from transformers import DynamicCache

    model = models("tiny-llama")
    ids = tokens(1, 30, seed=8)
    plain = DynamicCache(config=model.config)
    model(ids, cache=plain, use_cache=True)
    cache = EvictionCache(model, make_policy("knorm", budget=10, recent_ratio=recent_ratio), protocol="prefill")
    model(ids, cache=cache, use_cache=True)
    for layer in range(2):
        norms = plain.layers[layer].keys[0].norm(dim=-1)  # [KV heads, 30]
        for head in range(2):
            smallest = norms[head, : 30 - recent].argsort()[: 10 - recent].tolist()
            held = cache.layers[layer].position[0, head][cache.layers[layer].held[0, head]]
            assert sorted(held.tolist()) == sorted(smallest + list(range(30 - recent, 30)))


@torch.no_grad()
@pytest.mark.parametrize("name", fast_sample(registered("prefill", evicting=True), lambda name: name in FAST_POLICIES))
def test_capacity_after_the_prompt_holds_at_every_step_per_layer_and_head(models, name):
    """Prefill 30 tokens at C = 12, then 10 decode steps. Evicting policies hold exactly C per (layer, head) at
    every step; policies that grow hold what compression kept plus every later token: per layer (PyramidKV's C
    falls with depth), per head (heads that share their layer's slots differ, their layer summing to Hkv * C)."""
    model, tokenizer = models("tiny-llama"), load_model("tiny-llama")[1]
    policy = example_policy(name, 12)
    ids = tokens(2, 40, seed=9)
    cache = EvictionCache(model, policy, protocol="prefill")
    model(ids[:, :30], cache=cache, use_cache=True)
    settle(model, cache, tokenizer, ids[:, :30], torch.ones_like(ids[:, :30]), [[], []], max_new_tokens=2)
    after_prompt = [layer.held.sum(-1).clone() for layer in cache.layers]
    if type(policy).allocate is not Policy.allocate:  # a selection across layers keeps Hkv * C per layer on average
        assert (sum(held.sum(-1) for held in after_prompt) == 2 * 2 * policy.plan(30).capacity).all()
        after_prompt = []
    for layer, held in enumerate(after_prompt):
        planned = policy.plan(30, layer, 2).capacity
        if policy.rule.safeguard is not None:
            assert (held.sum(-1) == 2 * planned).all() and (held >= policy.plan(30, layer, 2).recent).all()
        else:
            assert (held == planned).all()
    for step in range(30, 40):
        model(ids[:, step : step + 1], cache=cache, use_cache=True)
        for layer, held in zip(cache.layers, after_prompt, strict=False):
            grown = step - 29 if policy.rule.grows else 0
            assert torch.equal(layer.held.sum(-1), held + grown)
            recent = set(range(step + 1 - policy.plan(30).recent, step + 1))
            for b, h in itertools.product(range(2), range(2)):
                assert recent <= set(layer.position[b, h][layer.held[b, h]].tolist())


@torch.no_grad()
def test_tova_keeps_one_token_set_per_layer_as_its_authors_do(models):
    """EvictionCache on tiny Llama (2 KV heads): prefill 30 tokens at C = 12, then 10 decode steps. With the
    authors' layer-wide ranking (the default) both KV heads of every layer hold the same positions after the
    prompt and after each step; ranked per KV head (heads=kv) they part somewhere."""
    model = models("tiny-llama")
    ids = tokens(2, 40, seed=9)
    alike = {}
    for heads in ("layer", "kv"):
        cache = EvictionCache(model, make_policy("tova", budget=12, heads=heads), protocol="prefill")
        model(ids[:, :30], cache=cache, use_cache=True)
        same = []
        for step in range(30, 41):
            for layer in cache.layers:
                kept = [sorted(layer.position[b, h][layer.held[b, h]].tolist()) for b in range(2) for h in range(2)]
                same.append(kept[0] == kept[1] and kept[2] == kept[3])
            if step < 40:
                model(ids[:, step : step + 1], cache=cache, use_cache=True)
        alike[heads] = all(same)
    assert alike == {"layer": True, "kv": False}


def test_fraction_budget_without_a_length_is_refused_token_by_token(models):
    model = models("tiny-llama")
    cache = EvictionCache(model, make_policy("h2o", budget=0.2))
    with pytest.raises(ConfigError, match="a fraction budget needs a length"):
        model(tokens(1, 1), cache=cache, use_cache=True)


@pytest.mark.parametrize("kernels", fast_sample(["torch", "auto", "triton"], lambda kernels: kernels == "torch"))
def test_no_tensor_of_the_mechanism_is_made_on_a_fixed_device(kernels):
    """Every registered policy in every protocol, prompt and decode steps, with torch's default device set to
    ``meta``: a tensor built without the device of its inputs lands there and the run fails (a CUDA run would
    fail the same way on a tensor built on the CPU)."""
    from h2o_eval import generation

    model, tokenizer = load_model("tiny-llama", device="cpu")
    ids = torch.randint(5, 400, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    for name in POLICIES:
        policy = example_policy(name)
        for protocol in policy.protocols:
            with torch.device("meta"):
                if protocol == "simulate":
                    with patch(model, policy, protocol="simulate", kernels=kernels):
                        model(ids, attention_mask=mask)
                elif policy.has_cache:
                    batch = generation.Batch(ids, mask, 8 if protocol == "context" else None)
                    generation.generate(
                        model, policy, batch, tokenizer, protocol=protocol, kernels=kernels, max_new_tokens=3,
                        do_sample=False,
                    )  # fmt: skip
