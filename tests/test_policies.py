"""Policies: budgets become capacities and protected windows exactly as documented."""

from __future__ import annotations

import pytest
import torch

from h2o_eval.errors import ConfigError
from h2o_eval.policies import POLICIES, UNBOUNDED, Plan, Rule, example_policy, make_policy


@pytest.mark.parametrize(
    ("budget", "length", "capacity"),
    [
        (0.2, 100, 20),
        (0.2, 101, 21),
        (0.1, 30, 3),
        (0.2, 3, 1),
        (0.2, 1, 1),
        (1.0, 57, 57),
        (0.5, 7, 4),
        (8, 100, 8),
        (8, 5, 8),
        (1, 9, 1),
    ],
)
def test_capacity_rounds_fractions_up_and_counts_tokens_for_integers(budget, length, capacity):
    assert make_policy("h2o", budget=budget).capacity(length) == capacity


@pytest.mark.parametrize(
    ("name", "params", "length", "plan"),
    [
        ("h2o", {}, 100, Plan(capacity=20, recent=10)),
        ("h2o", {"heavy_ratio": 0.25}, 100, Plan(capacity=20, recent=15)),
        ("h2o", {"heavy_ratio": 0.0}, 100, Plan(capacity=20, recent=20)),
        ("h2o", {"heavy_ratio": 1.0}, 100, Plan(capacity=20, recent=1)),
        ("h2o", {}, 3, Plan(capacity=1, recent=1)),
        ("local", {}, 100, Plan(capacity=20, recent=20)),
        ("heavy", {}, 100, Plan(capacity=20, recent=1)),
        ("tova", {}, 100, Plan(capacity=20, recent=1)),
        ("streaming", {}, 100, Plan(capacity=20, recent=16, sinks=4)),
        ("streaming", {"sinks": 4}, 10, Plan(capacity=2, recent=1, sinks=1)),
        ("random", {"seed": 3}, 100, Plan(capacity=20, recent=10)),
        ("full", {}, 100, Plan(capacity=UNBOUNDED, recent=UNBOUNDED)),
        ("snapkv", {}, 1000, Plan(capacity=200, recent=32)),
        ("snapkv", {"window": 64}, 100, Plan(capacity=20, recent=20)),  # C <= window keeps the last C
        ("knorm", {}, 100, Plan(capacity=20, recent=0)),
        ("knorm", {"recent_ratio": 0.25}, 100, Plan(capacity=20, recent=5)),
        ("expected_attention", {}, 100, Plan(capacity=20, recent=0, sinks=4)),
        ("keydiff", {}, 100, Plan(capacity=20, recent=0)),
        ("kvzip", {"n_sink": 2}, 100, Plan(capacity=20, recent=0, sinks=2)),
        ("oracle", {}, 100, Plan(capacity=20, recent=1)),
        ("criticalkv", {}, 100, Plan(capacity=20, recent=0, sinks=4)),
        ("adakv", {"base": "knorm"}, 100, Plan(capacity=20, recent=0)),
        ("h2o_reference", {}, 100, Plan(capacity=21, recent=11)),
    ],
)
def test_plans(name, params, length, plan):
    assert make_policy(name, budget=0.2, **params).plan(length) == plan


def test_every_plan_leaves_room_for_an_eviction_candidate():
    for name in POLICIES:
        for length in (1, 2, 5, 17, 64):
            for budget in (0.05, 0.2, 0.5, 1.0, 1, 3):
                params = {"sinks": min(4, budget - 1)} if name == "streaming" and isinstance(budget, int) else {}
                params = POLICIES[name].example if name == "dms" else params  # a threshold instead of a budget
                policy = make_policy(name, budget=budget, **params)
                for layer in range(3):
                    plan = policy.plan(length, layer, 3)
                    assert plan.recent + plan.sinks <= plan.capacity
                    # a policy that evicts while decoding protects the token it is feeding
                    assert plan.recent >= 1 or policy.rule.grows, name
                    assert plan.capacity <= length or isinstance(budget, int) or name in ("full", "dms")


def test_unknown_policy_lists_the_valid_names():
    with pytest.raises(
        ConfigError, match=r"^policy=lru: no policy of that name: use one of adakv, block, chunk, chunkkv"
    ):
        make_policy("lru")


def test_unknown_parameter_names_the_valid_ones():
    with pytest.raises(ConfigError, match=r"policy 'local' takes no heavy_ratio"):
        make_policy("local", heavy_ratio=0.5)


@pytest.mark.parametrize("budget", [0, 0.0, -0.1, 1.5, True])
def test_bad_budgets_are_refused(budget):
    with pytest.raises(ConfigError, match="budget="):
        make_policy("h2o", budget=budget)


@pytest.mark.parametrize(
    ("budget", "heavy_ratio", "length", "budgets"),
    [
        (0.2, 0.5, 100, (10, 10)),
        (0.3, 0.5, 9, (1, 1)),
        (0.2, 0.5, 7, (0, 0)),
        (0.5, 0.25, 10, (1, 3)),
        (8, 0.5, 99, (4, 4)),
    ],
)
def test_h2o_reference_budgets_truncate_like_the_authors(budget, heavy_ratio, length, budgets):
    assert make_policy("h2o_reference", budget=budget, heavy_ratio=heavy_ratio).budgets(length) == budgets


@pytest.mark.parametrize(
    ("budget", "length", "layers", "capacities"),
    [
        # C = 20, window 4: 16 beyond it per layer on average. low = floor(16 / 20) = 0, high = 32 - 0 = 32; the
        # linear values 32, 24, 16, 8, 0 are integers already.
        (20, 100, 5, [36, 28, 20, 12, 4]),
        # 4 layers: 32, 21.33, 10.67, 0 -> floors 32, 21, 10, 0 (63); the one missing goes to the largest remainder
        # (10.67), so the layers sum to exactly 4 * 16.
        (20, 100, 4, [36, 25, 15, 4]),
        # A short prompt: C = 14 of 20, 10 beyond the window; high = 20 - 0 >= 20 - 4, so high = 16 and
        # low = 2 * 10 - 16 = 4, as in the authors' code: 16, 10, 4.
        (0.7, 20, 3, [20, 14, 8]),
    ],
)
def test_pyramidkv_capacities_fall_linearly_and_average_to_c(budget, length, layers, capacities):
    policy = make_policy("pyramidkv", budget=budget, window=4)
    assert [policy.plan(length, layer, layers).capacity for layer in range(layers)] == capacities
    assert sum(capacities) == layers * policy.capacity(length)
    assert all(policy.plan(length, layer, layers).recent == 4 for layer in range(layers))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("heads", "query", r"^Rule: heads='query': use one of kv, layer$"),
        ("votes", "windw", r"^Rule: votes='windw': use one of all, window, none$"),
        ("combine", "mean", r"^Rule: combine='mean': use one of add, replace$"),
        ("pooling", "min", r"^Rule: pooling='min': use one of max, avg$"),
        ("window", -1, r"^Rule: window=-1: use an integer >= 0$"),
        ("safeguard", 2.0, r"^Rule: safeguard=2.0: use a number in \[0, 1\]$"),
    ],
)
def test_a_rule_refuses_values_outside_its_enums_and_ranges(field, value, message):
    with pytest.raises(ConfigError, match=message):
        Rule(**{field: value})


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_registered_policy_validates_its_budget_and_parameters(name):
    """Generic: every registered policy (with its example parameters) refuses a bad budget and an unknown
    parameter in one line (but those with no budget: ``full``, and ``dms``, whose base a threshold decides at
    budget 1.0), and describes itself as built: every dataclass field, a wrapped base described the same way, as
    plain JSON."""
    import dataclasses
    import json

    for budget in (0, -0.5, 1.5, True):
        if name != "full" and getattr(POLICIES[name], "base_budget", None) is None:
            with pytest.raises(ConfigError, match=r"^budget=.*: use a fraction in \(0, 1\]"):
                example_policy(name, budget)
    with pytest.raises(ConfigError, match=r"takes no bogus: its parameters are"):
        make_policy(name, 0.5, **POLICIES[name].example, bogus=1)

    def fields_of(policy):
        described = {"name": policy.name}
        for field in dataclasses.fields(policy):
            value = getattr(policy, field.name)
            described[field.name] = fields_of(value) if dataclasses.is_dataclass(value) else value
        return described

    policy = example_policy(name, 0.5)
    assert policy.describe() == fields_of(policy)
    assert json.loads(json.dumps(policy.describe())) == policy.describe()


def test_policies_state_their_rules_as_data():
    assert make_policy("h2o").rule == Rule(votes="all")
    assert make_policy("tova").rule == Rule(votes="all", combine="replace", heads="layer")
    assert make_policy("tova", heads="kv").rule == Rule(votes="all", combine="replace")
    assert make_policy("snapkv", window=8, pooling="avg", kernel_size=5).rule == Rule(
        votes="window", window=8, pooling="avg", kernel_size=5, grows=True
    )
    assert make_policy("adakv", alpha=0.3).rule.safeguard == 0.3
    assert make_policy("adakv", base="knorm").rule == Rule(grows=True, safeguard=0.2)
    assert make_policy("local").rule == make_policy("full").rule == Rule()


def test_prompt_votes_weight_all_rows_the_last_or_the_window():
    """Two prompts of 5 and 3 real rows (the second right-padded, then one row past its prompt)."""
    rows = torch.tensor([[True] * 5 + [False], [True, True, True, False, False, False]])
    assert Rule(votes="all").prompt_weights(rows).tolist() == rows.float().tolist()
    last = [[0, 0, 0, 0, 1, 0], [0, 0, 1, 0, 0, 0]]
    assert Rule(votes="all", combine="replace").prompt_weights(rows).tolist() == last
    assert Rule(votes="window", window=2).prompt_weights(rows).tolist() == [[0, 0, 0, 1, 1, 0], [0, 1, 1, 0, 0, 0]]
    assert Rule().prompt_weights(rows) is None


def test_key_norm_scores_are_the_negative_l2_norms():
    key = torch.tensor([[[[3.0, 4.0], [0.0, 1.0]]]])
    assert make_policy("knorm").key_scores(key, torch.zeros(1, 1, 2), 0).tolist() == [[[-5.0, -1.0]]]


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("streaming", {"sinks": -1}, r"^streaming: sinks=-1: use an integer >= 0$"),
        ("streaming", {"sinks": 1.5}, r"^streaming: sinks=1.5: use an integer >= 0$"),
        ("streaming", {"sinks": 100, "budget": 3}, r"sinks=100 leaves no slot .* use sinks <= 2 or a larger budget"),
        ("h2o", {"heavy_ratio": "half"}, r"heavy_ratio='half': use a number in \[0, 1\]$"),
        ("h2o", {"heavy_ratio": 1.5}, r"heavy_ratio=1.5"),
        ("random", {"seed": 0.5}, r"seed=0.5: use an integer"),
        ("snapkv", {"window": 0}, r"window=0: use an integer >= 1"),
        ("snapkv", {"kernel_size": 4}, r"kernel_size=4: use an odd size"),
        ("snapkv", {"pooling": "min"}, r"pooling='min': use one of max, avg"),
        ("pyramidkv", {"beta": 0.5}, r"beta=0.5: use a number >= 1"),
        ("adakv", {"alpha": 2}, r"alpha=2: use a number in \[0, 1\]$"),
        ("adakv", {"base": "local"}, r"base='local' ranks no tokens by score .*: use a scoring policy such as snapkv"),
        ("adakv", {"base": "h2o_reference"}, r"base='h2o_reference' computes its own attention and holds no cache"),
        ("adakv", {"base": "nope"}, r"base='nope': use one of chunkkv, compactor, criticalkv, cur"),
        ("criticalkv", {"base": "local"}, r"^criticalkv: base='local' ranks no tokens by score"),
        ("criticalkv", {"first_stage_ratio": 2}, r"first_stage_ratio=2: use a number in \[0, 1\]$"),
        ("expected_attention", {"use_vnorm": "yes"}, r"^expected_attention: use_vnorm='yes': use true or false$"),
        ("expected_attention", {"n_sink": -1}, r"n_sink=-1: use an integer >= 0$"),
        ("kvzip", {"chunk_size": 0}, r"chunk_size=0: use an integer >= 1$"),
        ("kvzip", {"layerwise": 1}, r"^kvzip: layerwise=1: use true or false$"),
        ("knorm", {"recent_ratio": 1.5}, r"recent_ratio=1.5: use a number in \[0, 1\]$"),
        ("adakv", {"sinks": 2}, r"policy 'snapkv' takes no sinks"),
        ("tova", {"heads": "query"}, r"^tova: heads='query': use one of kv, layer$"),
        ("adakv", {"base": "tova"}, r"base='tova' with heads=layer keeps one token set per layer.*add heads=kv"),
    ],
)
def test_every_policy_parameter_is_checked_in_one_line(name, params, message):
    params = dict(params)
    with pytest.raises(ConfigError, match=message):
        make_policy(name, budget=params.pop("budget", 0.2), **params)


def test_a_wrappers_default_base_takes_its_defaults_whether_named_or_not():
    """criticalkv's default base is kvpress's critical_expected_attention (use_vnorm=false) from Python and from
    its config, which names the base; given parameters still override it."""
    from h2o_eval.grid import compose
    from h2o_eval.policies import configured_policy

    config = compose(["policy=criticalkv"])
    assert config["policy"]["base"] == "expected_attention"
    from_config = configured_policy(config)
    assert from_config.base.use_vnorm is False
    assert from_config == make_policy("criticalkv") == make_policy("criticalkv", base="expected_attention")
    assert make_policy("criticalkv", base="expected_attention", use_vnorm=True).base.use_vnorm is True


def test_a_wrapper_over_another_base_departs_in_that_bases_name_and_what_departs_from_its_yaml():
    """A record's name and a report's label carry the departures: AdaKV over Compactor (kvpress's adakv_compactor)
    is ``base.name=compactor``, not every parameter of Compactor that SnapKV (adakv's YAML base) lacks."""
    from h2o_eval.settings import policy_departures

    compactor = make_policy("adakv", 0.5, base="compactor").describe()
    assert policy_departures(compactor) == {"policy.base.name": "compactor"}
    departed = make_policy("adakv", 0.5, base="compactor", chunk_size=128, alpha=0.3).describe()
    assert policy_departures(departed) == {
        "policy.base.name": "compactor", "policy.base.chunk_size": 128, "policy.alpha": 0.3
    }  # fmt: skip
    assert policy_departures(make_policy("adakv", 0.5, base="snapkv", window=8).describe()) == {"policy.base.window": 8}
