"""``+experiment=kv_leaderboard`` runs kvpress's board entries with the parameters kvpress's board runs them with:
docs/leaderboard.md's table (each value with the kvpress file and line it comes from) against the policies the preset
builds, and PyramidKV's ``budgets=kvpress`` against kvpress's own formula."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from h2o_eval.conf import options
from h2o_eval.names import compose
from h2o_eval.policies import configured_policy, make_policy

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = {"oracle", "criticalkv", "h2o", "local", "heavy"}  # no entry of kvpress's board (docs say so)


def table() -> list[tuple[str, str, str, object, str]]:
    """docs/leaderboard.md's rows: (kvpress entry, policy, parameter, kvpress's value, source)."""
    text = (ROOT / "docs" / "leaderboard.md").read_text()
    section = text.split("### kvpress's board settings, and where kvpress sets them", 1)[1]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip().replace("`", "") for cell in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0] not in ("kvpress entry", "---"):
            entry, policy, parameter, value, source = cells
            rows.append((entry, policy, parameter, yaml.safe_load(value), source))
    return rows


def swept() -> list[str]:
    params = options("experiment")["kv_leaderboard"]["hydra"]["sweeper"]["params"]
    return str(params["policy"]).split(",")


def built(policy: str):
    config = compose(["+experiment=kv_leaderboard", "model=tiny-llama", f"policy={policy}"])
    return OmegaConf.to_container(config, resolve=True), configured_policy(OmegaConf.to_container(config, resolve=True))


def test_the_table_covers_every_policy_the_preset_sweeps_and_cites_a_kvpress_file_for_every_value():
    rows = table()
    assert len(rows) >= 30
    named = {policy for _, policy, *_ in rows}
    assert set(swept()) - EXTRAS == named - {"every policy"}
    for *_, source in rows:
        assert re.fullmatch(r"((kvpress|evaluation)/[\w/]+\.(py|sh):\d+(-\d+)?(; )?)+", source), source


@pytest.mark.parametrize("policy", sorted({row[1] for row in table()} - {"every policy"}))
def test_each_board_entry_is_built_with_kvpress_s_parameters(policy):
    _, made = built(policy)
    for _, named, parameter, value, _ in table():
        if named != policy:
            continue
        found = made
        for part in parameter.split("."):
            found = getattr(found, part)
        assert found == value, f"{policy}: {parameter}={found!r}, kvpress's board: {value!r}"


def test_every_policy_of_the_preset_runs_in_kvpress_s_protocol():
    params = options("experiment")["kv_leaderboard"]["hydra"]["sweeper"]["params"]
    settings = {parameter: value for _, named, parameter, value, _ in table() if named == "every policy"}
    assert str(params["budget"]) == settings.pop("budget")
    for policy in swept():
        config, _ = built(policy)
        for parameter, value in settings.items():
            found = config
            for part in parameter.split("."):
                found = found[part]
            assert found == value, f"{policy}: {parameter}={found!r}, kvpress's board: {value!r}"


def kvpress_layer_budget(q_len: int, ratio: float, layer: int, layers: int, window=64, beta=20) -> int:
    """kvpress 0.5.5's ``PyramidKVPress.get_layer_budget`` (kvpress/presses/pyramidkv_press.py:47-86), re-typed."""
    max_capacity_prompt = window + q_len * (1 - ratio)
    min_num = (max_capacity_prompt - window) / beta
    max_num = (max_capacity_prompt - window) * 2 - min_num
    if max_num >= q_len - window:
        max_num = q_len - window
        min_num = (max_capacity_prompt - window) * 2 - max_num
    if not (q_len >= max_num >= min_num >= window):
        return max(1, round(q_len * (1 - ratio)))
    steps = (max_num - min_num) / (layers - 1) if layers > 1 else 0.0
    return round(max_num - layer * steps)


@pytest.mark.parametrize("length", [700, 1281, 3997, 4096])
@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75, 0.875])
def test_pyramidkv_takes_kvpress_s_layer_budgets_the_window_inside_and_snapkv_s_where_the_pyramid_does_not_fit(
    length, ratio
):
    """Every layer's kept count is kvpress's (30 layers, as SmolLM2), its window kept; the paper's budgets (the
    default) differ, and both average C where kvpress builds a pyramid."""
    layers = 30
    policy = make_policy("pyramidkv", budget=1 - ratio, window=64, kernel_size=5, pooling="avg", budgets="kvpress")
    plans = [policy.plan(length, layer, layers) for layer in range(layers)]
    assert [p.capacity for p in plans] == [kvpress_layer_budget(length, ratio, i, layers) for i in range(layers)]
    assert all(p.recent == min(64, p.capacity) for p in plans)
    authors = make_policy("pyramidkv", budget=1 - ratio, window=64, kernel_size=5, pooling="avg")
    if len({p.capacity for p in plans}) > 1:
        assert [authors.plan(length, layer, layers).capacity for layer in range(layers)] != [p.capacity for p in plans]
        assert sum(p.capacity for p in plans) / layers == pytest.approx(length * (1 - ratio), rel=0.01)


def test_the_side_by_side_benchmark_runs_every_board_entry_of_the_preset_through_kvpress():
    """``benchmarks.board_compare`` builds kvpress's press for exactly the preset's board entries (the table's), each
    as kvpress's registry builds it (evaluation/evaluate_registry.py:90,93,96,104,106,108,112,113,115,117)."""
    from h2o_eval.benchmarks.board_compare import BOARD

    assert set(BOARD) == {row[1] for row in table()} - {"every policy"}
    assert BOARD["kvpress/expected_attention"] == "AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))"
    assert BOARD["full"] is None and all(BOARD[p].endswith("Press()") for p in ("keydiff", "knorm", "tova"))
