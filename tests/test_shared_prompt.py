"""One prompt pass for many policies: a :class:`SharedPrompt` leaves every cache as feeding it alone would, and
policies that score a prompt alike (or by the same extra passes) compute it once."""

from __future__ import annotations

import pytest
import torch
from conftest import make_config, registered

from h2o_eval import generation
from h2o_eval.cache import EvictionCache
from h2o_eval.groups import SharedPrompt
from h2o_eval.models import load_model
from h2o_eval.policies import configured_policy, example_policy, make_policy
from h2o_eval.run import validate
from h2o_eval.runners.long_context import RUNNER


@pytest.mark.parametrize("name", ["tiny-llama", pytest.param("tiny-gemma3", marks=pytest.mark.slow)])
@pytest.mark.parametrize("protocol", [pytest.param("prefill", marks=pytest.mark.slow), "context"])
def test_a_shared_prompt_leaves_each_cache_as_feeding_it_alone(name, protocol):
    """Reference: each policy's cache fed the (left-padded) prompt through a SharedPrompt of its own (no vote or
    prompt computation shared) and, apart, as an EvictionCache alone; implementation: one pass of the prompt through
    a SharedPrompt of all of them. Every layer of every cache is bit for bit its own SharedPrompt's: held slots,
    positions, keys, scores and kept tokens. A shared pass differs from the cache's own only in how the attention's
    output is rounded (computed once, as the full cache computes it), which reaches the later layers' inputs and may
    tip a choice made on a tie, such as entropy_gated_chunkkv's entropies one ulp apart at their median (torch
    2.13). So the first layer, fed the same inputs, is bit for bit the cache's own, and the shared pass's logits are
    the full cache's up to rounding. tiny-gemma3 has sliding layers, which keep their own window."""
    model, _ = load_model(name, device="cpu")
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(5, model.config.vocab_size, (2, 300), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :13] = 0

    def caches():
        return [EvictionCache(model, example_policy(name, 0.3), protocol=protocol) for name in registered(protocol)]

    def feed(cache):
        with torch.no_grad():
            return model(ids, attention_mask=mask, cache=cache, use_cache=True).logits

    alone = caches()
    logits = [feed(cache) for cache in alone]
    own = caches()
    for cache in own:
        feed(SharedPrompt([cache]))
    together = caches()
    shared_logits = feed(SharedPrompt(together))
    full = registered(protocol).index("full")
    torch.testing.assert_close(shared_logits, logits[full], rtol=1e-4, atol=1e-4)
    evicted = 0
    for policy, one, mine, other in zip(registered(protocol), alone, own, together, strict=True):
        for depth, (a, b) in enumerate(zip(mine.layers, other.layers, strict=True)):
            assert a.seen == b.seen, (policy, depth)
            for field in ("held", "position", "keys", "scores", "kept"):
                assert equal_or_none(getattr(a, field), getattr(b, field)), (policy, depth, field)
            evicted += int((~a.held).sum()) + (a.held.shape[-1] < 300) if a.window is None else 0
        first, shared_first = one.layers[0], mine.layers[0]
        for field in ("held", "position", "keys", "scores", "kept"):
            assert equal_or_none(getattr(first, field), getattr(shared_first, field)), (policy, field)
    assert evicted > 0


def equal_or_none(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is None and b is None or a is not None and b is not None and torch.equal(a, b)


def fed(model, ids, mask, policies):
    """Context-protocol caches of ``policies`` after one SharedPrompt pass of the left-padded ``ids``."""
    caches = [EvictionCache(model, p, protocol="context") for p in policies]
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=SharedPrompt(caches), use_cache=True)
    return caches


def test_caches_whose_rules_weigh_the_prompt_alike_compute_its_votes_once(monkeypatch):
    """Reference: each cache fed through a SharedPrompt of its own, computing its prompt's votes; implementation:
    H2O at three budgets and TOVA in one SharedPrompt, where H2O's votes (every prompt row weighed alike) are
    computed once per layer and TOVA's (its last row only) once more. Every cache's held slots and scores are
    exactly the reference's."""
    from h2o_eval.kernels import prompt

    model, _ = load_model("tiny-llama", device="cpu")
    ids = torch.randint(5, model.config.vocab_size, (2, 120), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    policies = [make_policy("h2o", b) for b in (0.2, 0.4, 0.6)] + [make_policy("tova", 0.3)]

    alone = [fed(model, ids, mask, [p])[0] for p in policies]
    calls, computed = [], prompt.column_scores_reference  # what the CPU path's prompt_votes runs
    monkeypatch.setattr(prompt, "column_scores_reference", lambda *a, **k: calls.append(1) or computed(*a, **k))
    together = fed(model, ids, mask, policies)
    assert len(calls) == 2 * model.config.num_hidden_layers
    for one, other in zip(alone, together, strict=True):
        for a, b in zip(one.layers, other.layers, strict=True):
            assert torch.equal(a.held, b.held) and torch.equal(a.scores, b.scores)


def test_policies_at_several_budgets_score_a_shared_prompt_once(monkeypatch):
    """Reference: each cache fed through a SharedPrompt of its own; implementation: Expected Attention at three
    budgets and CriticalKV (whose base is Expected Attention without the value norm) at two, in one SharedPrompt,
    the second row left-padded. Per layer, Expected Attention's softmax is computed once for both (they differ only
    in the value norms applied after it) and CriticalKV's projected value norms once; every cache's held slots and
    scores are exactly the reference's."""
    from h2o_eval.policies import criticalkv
    from h2o_eval.policies.expected_attention import ExpectedAttention

    model, _ = load_model("tiny-llama", device="cpu")
    ids = torch.randint(5, model.config.vocab_size, (2, 120), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    policies = [make_policy("expected_attention", b) for b in (0.2, 0.4, 0.6)]
    policies += [make_policy("criticalkv", b) for b in (0.3, 0.5)]

    alone = [fed(model, ids, mask, [p])[0] for p in policies]
    expected, norms = [], []
    scorer, projected = ExpectedAttention._expected, criticalkv.projected_value_norm
    monkeypatch.setattr(ExpectedAttention, "_expected", lambda *a: expected.append(1) or scorer(*a))
    monkeypatch.setattr(criticalkv, "projected_value_norm", lambda *a: norms.append(1) or projected(*a))
    together = fed(model, ids, mask, policies)
    layers = model.config.num_hidden_layers
    assert (len(expected), len(norms)) == (layers, layers)
    for one, other in zip(alone, together, strict=True):
        for a, b in zip(one.layers, other.layers, strict=True):
            assert torch.equal(a.held, b.held) and torch.equal(a.scores, b.scores)
            assert int(b.held.sum()) < int(mask.sum()) * b.held.shape[1]  # the prompt was compressed


@pytest.mark.slow
def test_cells_that_differ_in_budget_run_the_extra_passes_once(data_dir, tmp_path, monkeypatch):
    """Reference: KVzip's cells run one at a time, each with its own repeat passes; implementation: the cells in
    one evaluate_shared, where the three that differ only in budget run the passes once (the others take their
    scores) and a layerwise one, which scores alike but is another policy as built, runs its own. The answers,
    capacities and kept KV entries are the separate runs'."""
    from h2o_eval.policies.kvzip import KVzip

    settings = {"model": "tiny-llama", "task": "niah_single_1", "limit": 4, "batch_size": 2, "protocol": "context"}
    settings |= {"task.length": 700, "task.max_new_tokens": 8, "task.questions": 2, "policy": "kvzip"}
    cells = [{"budget": b} for b in (0.2, 0.4, 0.6)] + [{"budget": 0.4, "policy.layerwise": True}]
    configs = [validate(make_config(data_dir, tmp_path, **settings, **cell)).config for cell in cells]
    model, tokenizer = load_model("tiny-llama", device="cpu")
    separate = [RUNNER.evaluate(model, tokenizer, configured_policy(c), c) for c in configs]
    passes, counted = [], KVzip.passes
    monkeypatch.setattr(KVzip, "passes", lambda self, script: passes.append(self) or counted(self, script))
    shared = RUNNER.evaluate_shared(model, tokenizer, [(configured_policy(c), c) for c in configs])
    assert len(passes) == 2 * 2, "one run of the passes per batch for the budgets, one for layerwise"
    keys = ("id", "prediction", "capacity", "kv_entries", "generated_tokens")
    for one, together in zip(separate, shared, strict=True):
        assert [[o[k] for k in keys] for o in together.outputs] == [[o[k] for k in keys] for o in one.outputs]
        assert together.fields["capacity"] == one.fields["capacity"]
    # Three budgets keep three cache sizes (layerwise keeps as many as the model-wide selection at 0.4).
    assert len({tuple(o["kv_entries"] for o in one.outputs) for one in separate}) == 3


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["context", "prefill"])
def test_the_oracle_at_several_budgets_generates_each_full_answer_once(data_dir, tmp_path, monkeypatch, protocol):
    """Reference: the oracle's cells run one at a time, each generating the full cache's answers its passes need;
    implementation: the cells in one evaluate_shared, where each prompt's full answer is generated once. The
    answers, capacities and kept KV entries are the separate runs'."""

    settings = {"model": "tiny-llama", "task": "niah_single_1", "limit": 4, "batch_size": 2, "protocol": protocol}
    settings |= {"task.length": 700, "task.max_new_tokens": 8, "task.questions": 2, "policy": "oracle"}
    configs = [validate(make_config(data_dir, tmp_path, **settings, budget=b)).config for b in (0.2, 0.4, 0.6)]
    model, tokenizer = load_model("tiny-llama", device="cpu")
    separate = [RUNNER.evaluate(model, tokenizer, configured_policy(c), c) for c in configs]
    # The full answers: under context from a copy of the cache's context, under prefill by feeding the prompt.
    owner, name = (EvictionCache, "full_copy") if protocol == "context" else (generation.passes, "answers")
    calls, answering = [], getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *args, **kwargs: calls.append(1) or answering(*args, **kwargs))
    shared = RUNNER.evaluate_shared(model, tokenizer, [(configured_policy(c), c) for c in configs])
    questions = sum(len(o.outputs) for o in separate[:1])
    assert 0 < len(calls) <= questions, "each batch's prompts answered once, not once per budget"
    keys = ("id", "prediction", "capacity", "kv_entries", "generated_tokens")
    for one, together in zip(separate, shared, strict=True):
        assert [[o[k] for k in keys] for o in together.outputs] == [[o[k] for k in keys] for o in one.outputs]
    assert len({tuple(o["kv_entries"] for o in one.outputs) for one in separate}) == 3


@pytest.mark.parametrize("decoding", ["grow", "evict"])
def test_the_oracles_full_answers_under_context_are_the_full_caches_from_a_copy(monkeypatch, decoding):
    """Reference: a full cache fed the (left-padded) context, then answering the questions, as the ``full`` cell
    does; implementation: the oracle's cache fed the same context, whose full answers come from a copy of it
    (``EvictionCache.full_copy``), the context never fed again. The copy holds what the full cache holds, and the
    answers are the same tokens."""
    from h2o_eval.policies import Full

    model, tokenizer = load_model("tiny-llama", device="cpu")
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(5, model.config.vocab_size, (2, 90), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :11] = 0
    questions = torch.randint(5, model.config.vocab_size, (2, 7), generator=generator)
    batch = generation.Batch(torch.cat([ids, questions], 1), torch.cat([mask, torch.ones_like(questions)], 1), 90)
    greedy = {"max_new_tokens": 12, "do_sample": False}
    full = EvictionCache(model, Full(), protocol="context", decoding=decoding)
    oracle = EvictionCache(model, make_policy("oracle", 0.3), protocol="context", decoding=decoding)
    for cache in (full, oracle):
        generation.feed(model, cache, ids, mask)
    for a, b in zip(full.layers, oracle.full_copy().layers, strict=True):
        assert all(torch.equal(getattr(a, n), getattr(b, n)) for n in ("keys", "values", "held", "position"))
        assert torch.equal(a.plan.capacity, b.plan.capacity) and a.plan.unbounded and b.plan.unbounded
    sequences = generation.complete(model, full, batch, tokenizer, **greedy)
    expected = generation.new_tokens(sequences, batch.input_ids.shape[1], generation.end_tokens(tokenizer))
    assert all(len(answer) > 3 for answer in expected) and expected[0] != expected[1]
    monkeypatch.setattr(
        "h2o_eval.generation.passes.answers", lambda *args, **kwargs: pytest.fail("the context was fed again")
    )
    answered = {}
    generation.complete(model, oracle, batch, tokenizer, answered, **greedy)
    assert list(answered.values()) == [expected]


def test_only_one_prompt_under_one_scoring_shares_extra_passes():
    """A cache takes another's extra-pass scores only when their policies differ in budget alone and they hold
    the same prompt; anything else is refused in one line."""
    model, _ = load_model("tiny-llama", device="cpu")
    ids = torch.randint(5, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))

    def fed(policy, tokens=ids):
        cache = EvictionCache(model, policy, protocol="context")
        with torch.no_grad():
            model(tokens, cache=cache, use_cache=True)
        return cache

    first = fed(make_policy("kvzip", 0.5))
    fed(make_policy("kvzip", 0.25)).adopt_rehearsal(first)
    with pytest.raises(ValueError, match="differ in budget"):
        fed(make_policy("kvzip", 0.25, layerwise=True)).adopt_rehearsal(first)
    with pytest.raises(ValueError, match="different prompts"):
        fed(make_policy("kvzip", 0.25), ids[:, :30]).adopt_rehearsal(first)
