"""The section 3 statistics are checked on hand-made attention matrices whose answers are known in closed form;
the requests against lm-eval's own COPA/Winogrande prompts; the CLI end to end on the tiny random Llama."""

from __future__ import annotations

import json
import math

import pytest
import torch

from h2o_eval import analyze
from h2o_eval.errors import ConfigError


def uniform_causal(heads: int, length: int) -> torch.Tensor:
    """Row i attends 1/(i+1) to every key j <= i."""
    rows = torch.arange(1, length + 1, dtype=torch.float32)[:, None]
    return (torch.ones(length, length).tril() / rows).expand(heads, length, length)


def one_hot_first(heads: int, length: int) -> torch.Tensor:
    """Every row puts all its attention on token 0 (an attention sink)."""
    attention = torch.zeros(heads, length, length)
    attention[:, :, 0] = 1.0
    return attention


def test_uniform_attention_has_no_entry_below_the_threshold():
    assert analyze.sparsity_counts(uniform_causal(3, 10)) == (0, 3 * 55)


def test_one_hot_attention_is_sparse_everywhere_but_the_sink():
    below, total = analyze.sparsity_counts(one_hot_first(2, 10))
    assert (below, total) == (2 * 45, 2 * 55)  # all causal entries off column 0: T(T-1)/2 per head


def test_sparsity_is_strictly_below_threshold_times_row_max_and_ignores_future_keys():
    attention = torch.tensor([[[1.0, 9.0, 9.0], [1.0, 0.25, 9.0], [0.5, 0.125, 0.0625]]])
    # Row 1: 0.25 is exactly 0.25 x its max 1.0, not below. Row 2: 0.0625 < 0.25 x 0.5. The 9s are future keys.
    assert analyze.sparsity_counts(attention, threshold=0.25) == (1, 6)


def test_accumulated_scores_are_causal_column_sums_over_rows_and_heads():
    heads, length = 3, 6
    expected = [heads * sum(1 / (i + 1) for i in range(j, length)) for j in range(length)]
    assert analyze.accumulated_scores(uniform_causal(heads, length)).tolist() == pytest.approx(expected)
    future = one_hot_first(1, 4) + torch.ones(4, 4).triu(1)  # attention to future keys does not count
    assert analyze.accumulated_scores(future).tolist() == [4.0, 0.0, 0.0, 0.0]


def test_ranked_puts_the_largest_score_first():
    assert analyze.ranked(torch.tensor([0.1, 3.0, 0.0, 2.0])).tolist() == pytest.approx([3.0, 2.0, 0.1, 0.0])


def test_a_single_heavy_hitter_holds_the_whole_top_share():
    scores = analyze.accumulated_scores(one_hot_first(4, 12))
    assert analyze.top_share(scores, 0.05) == 1.0
    assert analyze.top_share(scores, 0.2) == 1.0


@pytest.mark.parametrize(("length", "share", "tokens"), [(15, 0.2, 3), (21, 0.05, 2), (10, 0.05, 1), (100, 0.07, 7)])
def test_top_share_takes_ceil_of_share_times_length_tokens(length, share, tokens):
    scores = torch.arange(length, 0, -1, dtype=torch.float64)  # length, ..., 1: token k holds length - k
    top = sum(range(length, length - tokens, -1))
    assert analyze.top_share(scores.flip(0), share) == pytest.approx(top / scores.sum().item())


def test_exact_power_law_gives_its_exponent():
    ranks = torch.arange(1, 41, dtype=torch.float64)
    assert analyze.power_law_exponent([7.0 * ranks**-1.5]) == pytest.approx(1.5, abs=1e-9)


def test_power_law_fit_pools_sequences_of_any_scale_and_skips_zero_scores():
    short = 100.0 * torch.arange(1, 11, dtype=torch.float64) ** -1.5
    long = 0.01 * torch.arange(1, 61, dtype=torch.float64) ** -1.5
    with_zeros = torch.cat([short, torch.zeros(5, dtype=torch.float64)])
    assert analyze.power_law_exponent([short, long, with_zeros]) == pytest.approx(1.5, abs=1e-9)
    assert math.isnan(analyze.power_law_exponent([torch.tensor([1.0, 0.0])]))


def test_mean_ranked_share_averages_normalised_scores_up_to_the_shortest_sequence():
    curve = analyze.mean_ranked_share([torch.tensor([3.0, 1.0]), torch.tensor([2.0, 1.0, 1.0])])
    assert curve == pytest.approx([(0.75 + 0.5) / 2, (0.25 + 0.25) / 2])


def test_layer_stats_pool_counts_over_sequences():
    stats = analyze.LayerStats()
    stats.add(one_hot_first(2, 10))
    stats.add(uniform_causal(2, 5))
    row = stats.summary(layer=0)
    assert row["sparsity"] == (2 * 45) / (2 * 55 + 2 * 15)
    uniform_top = sum(1 / (i + 1) for i in range(5)) / 5  # token 0 of T=5 uniform rows: H_5 of the 5 rows' mass
    assert row["top5_share"] == pytest.approx((1.0 + uniform_top) / 2)


def test_requests_are_lm_eval_contexts_with_the_gold_continuation(data_dir):
    copa = analyze.request_texts(analyze.task_config("copa"), data_dir, limit=2)
    assert copa == [
        "The man turned on the faucet therefore  water flowed from the spout.",
        "The girl found a bug in her cereal therefore  she lost her appetite.",
    ]
    winogrande = analyze.request_texts(analyze.task_config("winogrande"), data_dir, limit=2)
    assert winogrande == [  # the gold option fills the blank in the context
        "Sarah was a much better surgeon than Maria so Maria always got the easier cases.",
        "Sarah was a much better surgeon than Maria so Sarah always got the harder cases.",
    ]


def test_few_shot_requests_prepend_other_documents_before_the_same_request(data_dir):
    zero = analyze.request_texts(analyze.task_config("copa"), data_dir, limit=3)
    shots = analyze.request_texts(analyze.task_config("copa"), data_dir, limit=3, num_fewshot=2)
    for alone, with_examples in zip(zero, shots, strict=True):
        assert with_examples.endswith(alone) and len(with_examples) > 2 * len(alone)
        assert with_examples.count(" therefore ") + with_examples.count(" because ") == 3  # 2 examples + the request


def test_unknown_or_generation_task_is_refused_listing_the_log_likelihood_tasks():
    with pytest.raises(ConfigError, match="unknown task 'nope': use one of copa, mathqa, openbookqa, piqa, rte, wino"):
        analyze.task_config("nope")
    with pytest.raises(ConfigError, match="'xsum' is a generation task: .* use one of copa"):
        analyze.task_config("xsum")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "nope"], "error: unknown model 'nope': use one of "),
        (["--task", "cnn_dailymail"], "error: task 'cnn_dailymail' is a generation task"),
        (["--limit", "0"], "error: --limit 0: use a document count >= 1"),
        (["--num-fewshot", "-1"], "error: --num-fewshot -1: use an integer >= 0"),
    ],
)
def test_cli_bad_setting_is_a_one_line_error(args, message, data_dir, tmp_path, capsys):
    with pytest.raises(SystemExit):
        analyze.main(["--model", "tiny-llama", "--data-dir", str(data_dir), "--out", str(tmp_path), *args])
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and "\n" not in err
    assert not list(tmp_path.iterdir())


def test_cli_writes_observations_per_layer_and_both_figures(data_dir, tmp_path, capsys):
    out = tmp_path / "observations"
    analyze.main(
        ["--model", "tiny-llama", "--task", "copa", "--data-dir", str(data_dir), "--limit", "3", "--out", str(out)]
        + ["--num-fewshot", "1"]
    )
    record = json.loads((out / "observations.json").read_text())
    assert (record["model"], record["task"], record["num_fewshot"], record["n_sequences"], record["threshold"]) == (
        "tiny-llama",
        "copa",
        1,
        3,
        0.01,
    )
    assert record["tokens"]["min"] >= 5 and record["tokens"]["total"] >= 3 * record["tokens"]["min"]
    assert [row["layer"] for row in record["layers"]] == [0, 1]  # tiny-llama has 2 layers
    for row in record["layers"]:
        for key in ("sparsity", "top5_share", "top20_share"):
            assert 0.0 <= row[key] <= 1.0
        assert row["top5_share"] <= row["top20_share"]
        assert math.isfinite(row["alpha"]) and row["alpha"] > 0  # causal attention always favours early tokens
        assert len(row["mean_ranked_share"]) == record["tokens"]["min"]
    for name in ("sparsity.png", "heavy_hitters.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name in ("sparsity.pdf", "heavy_hitters.pdf"):
        assert (out / name).read_bytes()[:5] == b"%PDF-"
    table = capsys.readouterr().out.splitlines()[-3:]
    assert table[0].split() == ["layer", "sparsity", "%", "alpha", "top5", "%", "top20", "%"]
    assert [line.split()[0] for line in table[1:]] == ["0", "1"]
