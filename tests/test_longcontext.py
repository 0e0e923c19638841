"""The long-context runner: RULER's documents (h2o_eval.ruler, tested in test_ruler.py) wrapped as kvpress wraps
them, answered on a tiny Llama, K questions per compressed context, scored with RULER's metric."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import fast_sample, make_config

from h2o_eval import EvictionCache, load_model, make_policy
from h2o_eval.errors import ConfigError
from h2o_eval.generation import end_tokens, new_tokens
from h2o_eval.run import run, validate
from h2o_eval.runners.long_context import prompts, score, wrap

SETTINGS = {"model": "tiny-llama", "task": "niah_single_1", "limit": 3, "batch_size": 2}
SETTINGS |= {"task.length": 700, "task.max_new_tokens": 6, "task.questions": 3}


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama", device="cpu")


def outputs(folder, record) -> list[dict]:
    return [json.loads(line) for line in (folder / record["outputs"]).read_text().splitlines()]


@pytest.mark.slow
def test_the_cli_writes_a_line_per_question_with_its_document_and_depths(tmp_path, data_dir):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline"}
    args = ["model=tiny-llama", "task=niah_single_1", "task.length=700", "task.questions=2", "policy=h2o"]
    args += ["budget=0.5", "protocol=context", "limit=3", "batch_size=2", f"data_dir={data_dir}", "results_dir=out"]
    args += ["wandb.mode=disabled"]
    done = subprocess.run(
        [sys.executable, "-m", "h2o_eval", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [path] = (tmp_path / "out").glob("*.json")
    record = json.loads(path.read_text())
    assert (record["n_questions"], record["n_documents"], record["n_samples"]) == (6, 3, 6)
    assert record["length"] == 700 and record["fit_tokenizer"] == "model" and record["protocol"] == "context"
    rows = outputs(tmp_path / "out", record)
    assert [o["id"] for o in rows] == ["0/0", "0/1", "1/0", "1/1", "2/0", "2/1"]
    assert [o["document"] for o in rows] == [0, 0, 1, 1, 2, 2]
    for row in rows:
        assert row["depth"] == row["depths"][0] and 0 <= row["depth"] <= 100
        assert row["scores"]["string_match_all"] == score({"metric": "string_match_all"}, row["prediction"],
                                                          row["answers"])  # fmt: skip
        assert row["budget_tokens"] == row["context_tokens"] < row["prompt_tokens"]
    assert record["metrics"]["string_match_all"] == pytest.approx(
        sum(o["scores"]["string_match_all"] for o in rows) / 6
    )
    assert 0.5 <= record["capacity"]["kept_fraction_mean"] <= 0.51, "h2o at 50 % keeps ceil(0.5 n) of each context"


def answer_alone(model, tokenizer, policy, protocol, context, question, new):
    """Reference: one question of one document, alone, through a fresh cache: the context (``context`` protocol:
    compressed before the question exists) or the whole prompt (``prefill``), then greedy decoding."""
    cache = EvictionCache(model, policy, protocol=protocol)
    prompt = torch.tensor([context + question])
    if protocol == "context":
        model(torch.tensor([context]), cache=cache, use_cache=True)
    out = model.generate(prompt, cache=cache, max_new_tokens=new, do_sample=False, pad_token_id=0)
    [tokens] = new_tokens(out, prompt.shape[1], end_tokens(tokenizer))
    return tokenizer.decode(tokens, skip_special_tokens=True).strip()


@pytest.mark.parametrize(
    ("name", "protocol"),
    fast_sample([("full", "context"), ("h2o", "context"), ("snapkv", "context"), ("h2o", "prefill")],
                lambda case: case == ("h2o", "context")),
)  # fmt: skip
def test_each_question_answers_as_its_own_run_on_the_same_document(tmp_path, data_dir, tiny, name, protocol):
    """Reference: each (document, question) alone through a fresh cache (:func:`answer_alone`); implementation:
    the runner with 3 questions per document in batches of 2 documents. Under ``context`` the batch's contexts are
    compressed once and every question answered from its own copy of the compressed cache (questions of other
    lengths in other groups), so no question sees another's tokens or answer; under ``prefill`` each question is
    compressed with its context."""
    model, tokenizer = tiny
    config = validate(make_config(data_dir, tmp_path, **SETTINGS, policy=name, budget=0.3, protocol=protocol)).config
    record = run(config, tmp_path / "work")
    rows = outputs(tmp_path, record)
    items = {p.document["index"]: p for p in prompts(tokenizer, config)}
    policy = make_policy(name, budget=0.3, **({"window": 32} if name == "snapkv" else {}))
    lengths = set()
    for row in rows:
        prompt = items[row["document"]]
        question = prompt.question_ids[row["question"]]
        lengths.add(len(question))
        expected = answer_alone(model, tokenizer, policy, protocol, prompt.context_ids, question, 6)
        assert row["prediction"] == expected, row["id"]
    assert len(rows) == 9 and len(lengths) > 1, "questions of one length prove nothing about the grouping"
    assert len({row["prediction"] for row in rows}) > 1


@torch.no_grad()
def test_decoding_grow_keeps_every_token_after_the_compression(tiny):
    """kvpress's protocol: after the context is compressed to C = 10, nothing is evicted (``decoding=grow``): the
    question's tokens add to the cache; under the policy's own rule (``evict``) H2O holds C."""
    model, _ = tiny
    ids = torch.randint(100, 4000, (1, 45), generator=torch.Generator().manual_seed(0))
    held = {}
    for decoding in ("evict", "grow"):
        cache = EvictionCache(model, make_policy("h2o", budget=0.25), protocol="context", decoding=decoding)
        model(ids[:, :40], cache=cache, use_cache=True)
        after = [int(layer.held.sum(-1).max()) for layer in cache.layers]
        for step in range(40, 45):
            model(ids[:, step : step + 1], cache=cache, use_cache=True)
        held[decoding] = (after, [int(layer.held.sum(-1).max()) for layer in cache.layers])
    assert held == {"evict": ([10, 10], [10, 10]), "grow": ([10, 10], [15, 15])}
    with pytest.raises(ConfigError, match="^decoding=grow keeps every token .* use protocol=prefill or context"):
        EvictionCache(model, make_policy("h2o", budget=0.25), protocol="simulate", decoding="grow")


def test_the_chat_template_wraps_the_context_as_kvpress_does(tiny):
    """kvpress's preprocess: the user turn holds the context then the question; the question's tokens carry the
    end of the user turn, the assistant header and the answer prefix; without a template, BOS + context, then
    question + newline + answer prefix."""
    _, tokenizer = tiny
    document = {"context": "Some text.\n", "questions": [{"question": "What is it? ", "answer_prefix": "It is"}]}
    prompt = wrap(tokenizer, document)
    whole = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Some text.\nWhat is it? "}], add_generation_prompt=True, tokenize=False
    )
    assert tokenizer.decode(prompt.context_ids + prompt.question_ids[0]) == whole + "It is"
    assert tokenizer.decode(prompt.context_ids).endswith("Some text.\n")

    class Plain:
        chat_template, bos_token = None, "<s>"

        def encode(self, text, add_special_tokens=False):
            return list(text)

    plain = wrap(Plain(), document)
    assert "".join(plain.context_ids) == "<s>Some text.\n" and "".join(plain.question_ids[0]) == "What is it? \nIt is"


def test_scores_drop_control_characters_as_kvpress_does():
    assert score({"metric": "string_match_all"}, "\x00 1234567\n", ["1234567"]) == 1.0
    assert score({"metric": "string_match_part"}, "Paris or Rome", ["rome", "berlin"]) == 1.0
    assert score({"metric": "string_match_all"}, "Paris or Rome", ["rome", "berlin"]) == 0.5


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"task.questions": 0}, r"task.questions=0"),
        ({"task.fit_tokenizer": "gpt"}, r"task.fit_tokenizer='gpt': use one of model, llama3"),
        ({"num_fewshot": 2}, r"has no few-shot examples: drop num_fewshot=2"),
        ({"decoding": "keep"}, r"decoding='keep': use one of evict, grow"),
        ({"protocol": "simulate", "decoding": "grow"}, r"decoding=grow keeps every token"),
    ],
)
def test_bad_settings_stop_with_one_line(overrides, message, tmp_path, data_dir):
    with pytest.raises(ConfigError, match=message):
        validate(make_config(data_dir, tmp_path, model="tiny-llama", task="niah_single_1", **overrides))


def test_qa_is_checked_for_the_documents_its_limit_asks(tmp_path, data_dir):
    """K=2 questions on HotpotQA's 100: task.samples=100 asks 200, refused; limit=1 asks 2 of them, run."""
    settings = {"task.questions": 2, "task.length": 2048}
    validate(make_config(data_dir, tmp_path, model="tiny-llama", task="qa_2", limit=1, **settings))
    with pytest.raises(ConfigError, match=re.escape("asks 200 questions (100 documents x 2) of 100")):
        validate(make_config(data_dir, tmp_path, model="tiny-llama", task="qa_2", **settings))


def test_a_length_beyond_the_models_positions_stops_with_one_line(tmp_path, data_dir):
    """task.length beyond the positions in the model's config stops before the model loads; a length within them
    whose prompt in the model's tokens (here fitted in Llama-3's) and new tokens are not stops once the prompts
    exist, before any forward."""
    config = make_config(data_dir, tmp_path, model="tiny-llama", task="niah_single_1", limit=1, **{"task.length": 2100})
    with pytest.raises(ConfigError, match=re.escape("task.length=2100 exceeds tiny-llama's 2048 positions: use task.")):
        run(config)
    fitted = {"task.length": 2048, "task.fit_tokenizer": "llama3"}
    config = make_config(data_dir, tmp_path, model="tiny-llama", task="niah_single_1", limit=1, **fitted)
    with pytest.raises(ConfigError, match=re.escape("new tokens exceed tiny-llama's 2048 positions: use a smaller")):
        run(config)


def test_export_writes_each_question_without_loading_weights(tmp_path, data_dir, tiny, monkeypatch):
    """``python -m h2o_eval.export``: the lines are the documents the runner asks (same contexts, questions,
    references and token counts as its own prompts), and no model is loaded."""
    from h2o_eval import export, models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("export loaded a model"))
    args = [
        "model=tiny-llama",
        "task=niah_single_1",
        "task.length=700",
        "task.questions=2",
        "limit=3",
        "task.max_new_tokens=6",
    ]
    args += [f"data_dir={data_dir}", f"results_dir={tmp_path}", "wandb.mode=disabled", f"out={tmp_path / 'x.jsonl'}"]
    export.main(args)
    lines = [json.loads(line) for line in (tmp_path / "x.jsonl").read_text().splitlines()]
    config = validate(make_config(data_dir, tmp_path, **(SETTINGS | {"task.questions": 2}))).config
    expected = [(p, k) for p in prompts(tiny[1], config) for k in range(2)]
    assert len(lines) == 6 == len(expected)
    for line, (prompt, k) in zip(lines, expected, strict=True):
        question = prompt.document["questions"][k]
        assert (line["document"], line["question_index"]) == (prompt.document["index"], k)
        assert line["context"] == prompt.document["context"] and line["question"] == question["question"]
        assert line["outputs"] == question["outputs"] and line["depths"] == question["depths"]
        assert line["tokens"] == len(prompt.context_ids) + len(prompt.question_ids[k])
        assert all(answer in line["context"] for answer in line["outputs"])
    with pytest.raises(SystemExit):
        export.main(["model=tiny-llama", "task=copa", f"out={tmp_path / 'y.jsonl'}"])
