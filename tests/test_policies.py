"""Policies: budgets become capacities and protected windows exactly as documented."""

from __future__ import annotations

import pytest

from h2o_eval.errors import ConfigError
from h2o_eval.policies import POLICIES, Plan, make_policy


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
        ("full", {}, 100, Plan(capacity=100, recent=100)),
    ],
)
def test_plans(name, params, length, plan):
    assert make_policy(name, budget=0.2, **params).plan(length) == plan


def test_every_plan_leaves_room_for_an_eviction_candidate():
    for name in POLICIES:
        for length in (1, 2, 5, 17, 64):
            for budget in (0.05, 0.2, 0.5, 1.0, 1, 3):
                plan = make_policy(name, budget=budget).plan(length)
                assert plan.recent >= 1 and plan.recent + plan.sinks <= plan.capacity
                assert plan.capacity <= length or isinstance(budget, int) or name == "full"


def test_unknown_policy_lists_the_valid_names():
    with pytest.raises(ConfigError, match=r"unknown policy 'lru': use one of full, h2o, local, heavy, streaming, tova"):
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
