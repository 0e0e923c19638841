"""The reasoning tasks (MATH-500, AIME 2024/2025, GSM8K): kvpress's scorers reproduced exactly, math-verify's second
score, GSM8K's numbers, and a run through the one generation path."""

from __future__ import annotations

import json

import pytest
from conftest import make_config

from h2o_eval.errors import ConfigError
from h2o_eval.run import execute, validate
from h2o_eval.runners.reasoning import gsm8k_prediction, gsm8k_reference, kvpress_boxed, math_verify, scores


def kvpress_math500(pred_answer, true_answer):
    """kvpress's evaluation/benchmarks/math500/calculate_metrics.py (8bb29b9), re-typed: its extract_boxed and
    score_aime."""
    try:
        extracted = str(pred_answer.split("boxed{")[1].split("}")[0])
    except IndexError:
        extracted = None
    return extracted == str(true_answer)


def kvpress_aime25(pred_answer, true_answer):
    """kvpress's evaluation/benchmarks/aime25/calculate_metrics.py (8bb29b9), re-typed: the last ``boxed{``."""
    try:
        extracted = str(pred_answer.split("boxed{")[-1].split("}")[0])
    except IndexError:
        extracted = None
    return extracted == str(true_answer)


OUTPUTS = [  # (prediction, answer): hand-picked where the scorers' rules show
    ("so the answer is $\\boxed{70}$.", "70"),
    ("so the answer is $\\boxed{ 70 }$.", "70"),
    ("first \\boxed{3}, then correcting myself \\boxed{70}", "70"),
    ("first \\boxed{70}, then \\boxed{3}", "70"),
    ("$\\boxed{\\frac{14}{3}}$", "\\frac{14}{3}"),
    ("$\\boxed{\\frac{14}", "\\frac{14"),
    ("The answer is 70.", "70"),
    ("", "70"),
    ("\\boxed{}", ""),
    ("\\boxed{70", "70"),
    ("fbox{70} and boxed{70}", 70),
]


@pytest.mark.parametrize(("prediction", "answer"), OUTPUTS)
def test_the_boxed_scorers_are_kvpress_s_math500_and_aime25_scorers(prediction, answer):
    assert kvpress_boxed(prediction, answer, last=False) == kvpress_math500(prediction, answer)
    assert kvpress_boxed(prediction, answer, last=True) == kvpress_aime25(prediction, answer)


def test_the_scorers_part_where_kvpress_s_string_match_cannot_see_equal_values():
    """kvpress's first-box scorer cuts a nested answer at its first ``}`` and compares strings; math-verify parses
    both and compares values."""
    task = {"scorer": "first_boxed"}
    answer = "\\left( 3, \\frac{\\pi}{2} \\right)"
    nested = scores(task, f"Hence $\\boxed{{{answer}}}$.", answer)
    assert nested == {"accuracy": 0.0, "math_verify": 1.0, "answered": 1.0}
    assert scores(task, "so $\\boxed{0.5}$", "\\frac{1}{2}") == {"accuracy": 0.0, "math_verify": 1.0, "answered": 1.0}
    assert scores(task, "so $\\boxed{4}$", "3") == {"accuracy": 0.0, "math_verify": 0.0, "answered": 1.0}
    assert scores(task, "so $\\boxed{3}$", "3") == {"accuracy": 1.0, "math_verify": 1.0, "answered": 1.0}
    assert not math_verify("no answer here", "3")


def test_gsm8k_compares_the_number_after_the_references_hashes_with_the_predictions_last_number():
    assert gsm8k_reference("She makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 1,018") == "1018"
    assert gsm8k_prediction("9 * 2 = 18, so she makes $1,018.") == "1018"
    assert gsm8k_prediction("no number") is None
    task = {"scorer": "gsm8k"}
    assert scores(task, "She makes $18.", "... #### 18") == {"accuracy": 1.0, "math_verify": 1.0, "answered": 1.0}
    assert scores(task, "18 eggs, then 20", "#### 18")["accuracy"] == 0.0
    assert scores(task, "I cannot tell", "#### 18") == {"accuracy": 0.0, "math_verify": 0.0, "answered": 0.0}


@pytest.mark.parametrize(("task", "rows"), [("math500", 500), ("aime24", 30), ("aime25", 30), ("gsm8k", 1319)])
def test_each_reasoning_task_reads_its_data_before_a_model_loads(data_dir, tmp_path, task, rows):
    spec = validate(make_config(data_dir, tmp_path, model="tiny-llama", task=task, policy="h2o", budget=256))
    assert spec.config["protocol"] == "prefill" and spec.runner.name == "reasoning"
    assert len(spec.runner.data_files(spec.config["task"], data_dir)) == 1
    assert sum(1 for _ in spec.runner.data_files(spec.config["task"], data_dir)[0].open()) == rows


def test_a_reasoning_task_is_refused_in_one_line_without_its_data_or_with_an_unknown_scorer(data_dir, tmp_path):
    with pytest.raises(ConfigError, match="task=math500 reads math500/test.jsonl: set data_dir"):
        validate(make_config(None, tmp_path, model="tiny-llama", task="math500", policy="h2o"))
    with pytest.raises(ConfigError, match="task.scorer='exact': use one of first_boxed, last_boxed, gsm8k"):
        validate(make_config(data_dir, tmp_path, model="tiny-llama", task="math500", policy="h2o",
                             **{"task.scorer": "exact"}))  # fmt: skip
    with pytest.raises(ConfigError, match="no data file"):
        validate(make_config(tmp_path, tmp_path, model="tiny-llama", task="gsm8k", policy="h2o"))


def test_a_reasoning_run_records_both_scores_the_share_answered_and_the_generated_lengths(data_dir, tmp_path):
    """Three MATH-500 problems under H2O at a budget of 48 tokens, which the prompt and the solution share (the
    cache stays at 48 while the solution grows): each output scored, the record's means and lengths its outputs'."""
    config = make_config(data_dir, tmp_path, model="tiny-llama", task="math500", policy="h2o", budget=48, limit=3,
                         **{"task.max_new_tokens": 12})  # fmt: skip
    _, record = execute(validate(config))
    outputs = [json.loads(line) for line in (tmp_path / record["outputs"]).read_text().splitlines()]
    assert [o["id"] for o in outputs] == ["test/precalculus/807.json", "test/intermediate_algebra/1994.json",
                                          "test/algebra/2584.json"]  # fmt: skip
    for key in ("accuracy", "math_verify", "answered"):
        assert record["metrics"][key] == pytest.approx(sum(o["scores"][key] for o in outputs) / 3)
    lengths = sorted(o["generated_tokens"] for o in outputs)
    generation = record["generation"]
    assert generation["generated_tokens_median"] == lengths[1]
    assert generation["hit_max_new_tokens"] == pytest.approx(sum(n >= 12 for n in lengths) / 3)
    assert all(o["capacity"] <= 48 for o in outputs) and generation["kv_peak_entries"] <= 48


def test_pass_at_k_is_the_share_of_k_subsets_of_the_samples_holding_a_right_one():
    """Reference: every k-subset of n samples enumerated; implementation: the unbiased estimator."""
    from itertools import combinations

    from h2o_eval.runners.reasoning import pass_at

    for n in (1, 4, 7):
        for correct in range(n + 1):
            right = [True] * correct + [False] * (n - correct)
            for k in range(1, n + 1):
                subsets = list(combinations(right, k))
                assert pass_at(n, correct, k) == pytest.approx(sum(map(any, subsets)) / len(subsets))


def test_first_difference_is_where_a_trace_departs_from_the_full_caches():
    from h2o_eval.runners.reasoning import first_difference

    assert first_difference([1, 2, 3], [1, 2, 3]) == 3
    assert first_difference([1, 9, 3], [1, 2, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference([4], [1]) == 0


def test_agreement_with_the_full_cache_is_the_same_read_from_its_record_or_generated(data_dir, tmp_path, monkeypatch):
    """Reference: the full cache's record and outputs, then the agreement computed by hand from both outputs files;
    implementation: the runner's agreement, once with the full cache's record in results_dir (read, nothing
    generated again) and once in an empty one (generated in the process). Both give the same numbers."""
    import statistics

    from h2o_eval.runners import reasoning

    common = {"model": "tiny-llama", "task": "math500", "limit": 3, "task.max_new_tokens": 10}
    _, full = execute(validate(make_config(data_dir, tmp_path / "a", policy="full", **common)))
    assert full["metrics"]["agreement"] == 1.0 and full["generation"]["agreement"]["same_trace"] == 1.0
    calls, solve = [], reasoning.solve
    monkeypatch.setattr(reasoning, "solve", lambda *a: calls.append(a[2].name) or solve(*a))
    monkeypatch.setattr(reasoning, "_FULL", {})
    _, read = execute(validate(make_config(data_dir, tmp_path / "a", policy="h2o", budget=40, **common)))
    assert calls == ["h2o"]
    _, generated = execute(validate(make_config(data_dir, tmp_path / "b", policy="h2o", budget=40, **common)))
    assert calls == ["h2o", "h2o", "full"]

    def rows(record, folder):
        return [json.loads(line) for line in (folder / record["outputs"]).read_text().splitlines()]

    mine, theirs = rows(read, tmp_path / "a"), rows(full, tmp_path / "a")
    departures = []
    for a, b in zip(mine, theirs, strict=True):
        same = [x == y for x, y in zip(a["token_ids"], b["token_ids"], strict=False)]
        departures.append(same.index(False) if False in same else min(len(a["token_ids"]), len(b["token_ids"])))
    assert read["metrics"]["agreement"] == pytest.approx(
        statistics.fmean(a["final_answer"] == b["final_answer"] for a, b in zip(mine, theirs, strict=True))
    )
    assert read["generation"]["agreement"]["first_difference_median"] == statistics.median(departures)
    assert min(departures) < 10, "h2o at 40 tokens should depart from the full cache here, or the test proves little"
    assert (
        generated["metrics"] == read["metrics"]
        and generated["generation"]["agreement"] == read["generation"]["agreement"]
    )


def test_sampled_solutions_name_their_seeds_repeat_under_them_and_give_pass_at_k(data_dir, tmp_path):
    from h2o_eval.runners.reasoning import pass_at

    overrides = {"model": "tiny-llama", "task": "gsm8k", "policy": "h2o", "budget": 48, "limit": 2,
                 "task.max_new_tokens": 6, "generation.sample": True, "generation.temperature": 1.0,
                 "generation.samples": 4, "seed": 7}  # fmt: skip
    _, record = execute(validate(make_config(data_dir, tmp_path / "a", **overrides)))
    _, again = execute(validate(make_config(data_dir, tmp_path / "b", **overrides)))
    outputs = [json.loads(line) for line in (tmp_path / "a" / record["outputs"]).read_text().splitlines()]
    assert record["generation"]["seeds"] == [7, 8, 9, 10] and record["n_samples"] == 8
    assert [(o["id"], o["sample"], o["seed"]) for o in outputs] == [(i, s, 7 + s) for s in range(4) for i in range(2)]
    assert len({tuple(o["token_ids"]) for o in outputs}) > 2, "sampled solutions should differ"
    repeated = [json.loads(line) for line in (tmp_path / "b" / again["outputs"]).read_text().splitlines()]
    assert [o["token_ids"] for o in repeated] == [o["token_ids"] for o in outputs]
    for k in (1, 2, 4):
        for score in ("accuracy", "math_verify"):
            expected = [pass_at(4, int(sum(o["scores"][score] for o in outputs if o["id"] == i)), k) for i in (0, 1)]
            assert record["metrics"][f"{score}_pass@{k}"] == pytest.approx(sum(expected) / 2)
    assert record["metrics"]["accuracy_pass@1"] == pytest.approx(record["metrics"]["accuracy"])
    assert "agreement" not in record["metrics"]


def test_several_greedy_samples_are_refused_in_one_line(data_dir, tmp_path):
    with pytest.raises(ConfigError, match="generation.samples=4 would repeat one greedy solution: set generation"):
        validate(make_config(data_dir, tmp_path, model="tiny-llama", task="math500", policy="h2o",
                             **{"generation.samples": 4}))  # fmt: skip


def test_the_reasoning_board_runs_each_policy_under_its_decoding_rule_and_each_task_to_its_length():
    """+experiment=reasoning's cells: the per-step policies and the full cache under decoding=evict, knorm and
    expected_attention under kvpress's DecodingPress (decoding=interval, compressing to the budget), DMS with its
    threshold, SmolLM2's MATH-500 to 1,024 new tokens and the rest to 512; the full cache is swept first (the
    others read its record)."""
    from omegaconf import OmegaConf

    from h2o_eval.grid import preset_sweep
    from h2o_eval.names import compose, expand

    jobs = expand(preset_sweep(["+experiment=reasoning"]))
    assert len(jobs) == 2 * 2 * 8 * 3
    configs = [OmegaConf.to_container(compose(job), resolve=True) for job in jobs]
    assert configs[0]["policy"]["name"] == "full"
    for config in configs:
        name = config["policy"]["name"]
        assert config["decoding"] == ("interval" if name in ("knorm", "expected_attention") else "evict"), name
        assert config["interval"]["target_size"] == config["budget"] and config["budget"] in (128, 256, 512)
        longest = (config["model"]["name"], config["task"]["name"]) == ("smollm2-135m", "math500")
        assert config["task"]["max_new_tokens"] == (1024 if longest else 512)
        assert config["protocol"] == "prefill" and config["limit"] == 10
    dms = [c["policy"] for c in configs if c["policy"]["name"] == "dms"]
    assert dms and all(p["threshold"] == -18.0 and p["decoding"] and p["base"] == "knorm" for p in dms)
