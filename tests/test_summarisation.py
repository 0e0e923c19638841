"""Summarisation under real eviction: HELM-style prompts, batched generation equal to one document at a time, and
ROUGE as rouge-score computes it."""

from __future__ import annotations

import json

import pytest
from conftest import fast_sample, make_config

from h2o_eval.run import run
from h2o_eval.runners.summarisation import build_prompts, rouge, template


def test_prompts_show_shots_in_helm_style_and_never_the_document_itself(data_dir):
    documents = [json.loads(line) for line in (data_dir / "xsum" / "test.jsonl").open()][:40]
    form = template({"template": "xsum"})
    prompts = build_prompts(documents, form, list(range(40)), num_fewshot=5, seed=1234, max_words=50)
    for index, prompt in enumerate(prompts):
        assert prompt.count("###\nArticle: ") == 6
        assert prompt.count("Summarize the above article in 1 sentence.\n") == 6
        query = " ".join(documents[index]["document"].split()[:50])
        assert prompt.endswith(f"###\nArticle: {query}\n\nSummarize the above article in 1 sentence.\n")
        assert prompt.count(query) == 1
        assert " ".join(documents[index]["summary"].split()) not in prompt
    shots = {p.split("###\nArticle: ")[1] for p in prompts}
    assert len(shots) == 2, "the same first example everywhere, except where it is the document itself"
    zero_shot = build_prompts(documents, form, [3], num_fewshot=0, seed=1234, max_words=50)[0]
    assert zero_shot.count("###") == 1


@pytest.mark.parametrize(
    "protocol", fast_sample(["prefill", "simulate", "context"], lambda protocol: protocol == "context")
)
def test_batched_generation_equals_one_document_at_a_time(tmp_path, data_dir, protocol):
    outputs = {}
    for batch_size in (1, 3):
        config = make_config(
            data_dir,
            tmp_path / f"b{batch_size}",
            model="tiny-gpt2",
            task="cnn_dailymail",
            policy="h2o",
            budget=0.2,
            protocol=protocol,
            limit=3,
            batch_size=batch_size,
            num_fewshot=1,
            **{"generation.max_new_tokens": 10, "generation.max_words": 60},
        )
        record = run(config, tmp_path / "work")
        rows = (tmp_path / f"b{batch_size}" / record["outputs"]).read_text().splitlines()
        outputs[batch_size] = [json.loads(row)["prediction"] for row in rows]
    assert outputs[1] == outputs[3]
    assert len(set(outputs[1])) > 1


@pytest.mark.slow
def test_record_rouge_equals_rouge_score_on_the_saved_outputs(tmp_path, data_dir):
    """SmolLM2, 0-shot on short articles: real summaries, so ROUGE is not trivially zero."""
    from rouge_score import rouge_scorer

    config = make_config(
        data_dir,
        tmp_path / "results",
        model="smollm2-135m",
        task="xsum",
        policy="h2o",
        budget=0.5,
        limit=4,
        batch_size=2,
        num_fewshot=0,
        **{"generation.max_new_tokens": 16, "generation.max_words": 80},
    )
    record = run(config, tmp_path / "work")
    rows = [json.loads(line) for line in (tmp_path / "results" / record["outputs"]).read_text().splitlines()]
    assert len(rows) == record["n_samples"] == 4
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    for name in ("rouge1", "rouge2", "rougeL"):
        recomputed = sum(scorer.score(r["reference"], r["prediction"])[name].fmeasure for r in rows) / len(rows)
        assert record["metrics"][name] == pytest.approx(recomputed, abs=1e-12)
        assert record["metrics"][name] == pytest.approx(sum(r["scores"][name] for r in rows) / len(rows), abs=1e-12)
    assert record["metrics"]["rouge1"] > 0
    assert all("###" not in r["prediction"] for r in rows)
    stats = record["generation"]
    assert stats["generated_tokens_per_s"] > 0 and 0 < stats["generated_tokens_mean"] <= 16
    assert 0 < stats["kv_peak_entries"] < stats["kv_full_entries"]
    assert stats["kv_peak_bytes"] / stats["kv_full_bytes"] == stats["kv_peak_entries"] / stats["kv_full_entries"]


def test_rouge_scores_match_hand_computed_values():
    (score,) = rouge(["the cat sat on the mat"], ["the cat is on the mat"])
    assert score["rouge1"] == pytest.approx(5 / 6)
    assert score["rouge2"] == pytest.approx(3 / 5)


def test_full_policy_peak_kv_is_the_full_cache(tmp_path, data_dir):
    config = make_config(
        data_dir,
        tmp_path / "results",
        model="tiny-gpt2",
        task="xsum",
        policy="full",
        limit=3,
        batch_size=2,
        num_fewshot=0,
        **{"generation.max_new_tokens": 6, "generation.max_words": 40},
    )
    record = run(config, tmp_path / "work")
    stats, capacity = record["generation"], record["capacity"]
    assert stats["kv_peak_entries"] == stats["kv_full_entries"] > 0
    assert capacity["kept_fraction_mean"] == 1.0 and capacity["length_mean"] == stats["prompt_tokens_mean"]
