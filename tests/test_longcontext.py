"""RULER-style synthetic tasks: the generator (deterministic, fitted to the length, needles at their depth) is
checked with the tokenizer alone; the scorer against hand-written outputs; the CLI on a tiny Llama."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from collections import Counter

import pytest
from conftest import make_config

from h2o_eval.errors import ConfigError
from h2o_eval.models import load_model
from h2o_eval.run import run, validate
from h2o_eval.runners import long_context as longcontext
from h2o_eval.runners import task_registry

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe")


@pytest.fixture(scope="module")
def tokenizer():
    return load_model("tiny-llama", device="cpu")[1]


@pytest.fixture(scope="module")
def texts(data_dir):
    return longcontext.load_haystack(task_registry()["niah_single"], data_dir)


def document(name, tokenizer, texts, *, seed=3, index=0, length=1024, depth=50):
    return longcontext.make_document(
        task_registry()[name], tokenizer, texts, seed=seed, index=index, length=length, depth=depth
    )


@pytest.mark.parametrize("name", TASKS)
def test_a_document_is_a_function_of_its_seed_and_index(name, tokenizer, texts):
    first = document(name, tokenizer, texts)
    assert first == document(name, tokenizer, texts)
    assert document(name, tokenizer, texts, seed=4)["prompt"] != first["prompt"]
    assert document(name, tokenizer, texts, index=1)["prompt"] != first["prompt"]


@pytest.mark.parametrize("name", TASKS)
@pytest.mark.parametrize("length", [1100, 2048])
def test_the_prompt_fills_the_target_length_as_context_then_question_ids(name, length, tokenizer, texts):
    """The prompt is short of the length by less than one haystack word, or one common word's list entries."""
    found = document(name, tokenizer, texts, length=length)
    total = len(found["context_ids"]) + len(found["question_ids"])
    assert total == found["length"]
    assert length - (16 if name == "cwe" else 8) <= total <= length
    assert tokenizer.decode(found["context_ids"]) + tokenizer.decode(found["question_ids"]) == found["prompt"]
    question = tokenizer.decode(found["question_ids"])
    assert question.startswith("\n") and question.endswith(
        "are" if name.startswith("niah") else ("are: " if name == "vt" else "are:")
    )
    assert found["prompt"].startswith("<|im_start|>system")  # SmolLM2's chat template
    assert all(answer not in question for answer in found["answers"])


def test_without_a_chat_template_the_prompt_is_plain_text(tokenizer, texts):
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    found = document("niah_single", plain, texts, length=600)
    assert found["prompt"].startswith("Some special magic numbers are hidden within the following text.")
    key = re.match(r"One of the special magic numbers for (\S+) is", found["needles"][0]).group(1)
    assert found["prompt"].endswith(
        f"for {key} mentioned in the provided text? The special magic numbers for {key} mentioned in the provided "
        "text are"
    )
    assert 596 <= found["length"] <= 600


def haystack_share(found, tokenizer, needle, start_marker, end_marker):
    """Where ``needle`` starts in the haystack, as a share of the haystack's tokens without the needles."""
    prompt = found["prompt"]

    def tokens(text):
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    start = prompt.index(start_marker) + len(start_marker)
    end = prompt.index(end_marker, start)
    at = prompt.index(needle)
    needles = sum(tokens(" " + n) for n in found["needles"])
    return (tokens(prompt[:at]) - tokens(prompt[:start])) / (tokens(prompt[:end]) - tokens(prompt[:start]) - needles)


@pytest.mark.parametrize("depth", [0, 25, 50, 75, 100])
@pytest.mark.parametrize("length", [1024, 4096])
def test_the_asked_needle_sits_at_its_depth_of_the_haystack(depth, length, tokenizer, texts):
    """Needles go between sentences: the nearest boundary is at most half a news sentence (~2 % of 1k tokens)
    from the asked depth."""
    found = document("niah_single", tokenizer, texts, length=length, depth=depth)
    assert len(found["needles"]) == 1 and found["answers"][0] in found["needles"][0]
    share = haystack_share(found, tokenizer, found["needles"][0], "afterwards.\n", "\nWhat are all")
    assert share == pytest.approx(depth / 100, abs=0.03)


@pytest.mark.parametrize("depth", [0, 50, 100])
def test_variable_tracking_starts_its_chain_at_the_depth_and_keeps_its_order(depth, tokenizer, texts):
    found = document("vt", tokenizer, texts, length=1500, depth=depth)
    statements = found["needles"]
    assert len(statements) == 5 and found["answers"] == re.findall(r"VAR (\w+) =", " ".join(statements))
    value = statements[0].split("= ")[1].rstrip(".")
    assert f"assigned the value {value}" in tokenizer.decode(found["question_ids"])
    main = found["prompt"].split("following text.\n\n")[-1]
    positions = [main.index(statement) for statement in statements]
    assert positions == sorted(positions)
    # The solved example before the instruction is not haystack: measure from the main instruction on.
    shifted = {**found, "prompt": found["prompt"][found["prompt"].rindex("following text.\n\n") :]}
    share = haystack_share(shifted, tokenizer, statements[0], "following text.\n\n", "\nQuestion: Find")
    assert share == pytest.approx(depth / 100, abs=0.04)


def test_multi_needle_tasks_hide_every_needle_and_ask_for_the_right_values(tokenizer, texts):
    def key_values(found):
        return [
            re.match(r"One of the special magic numbers for (\S+) is: (\d{7})\.", n).groups() for n in found["needles"]
        ]

    multikey = document("niah_multikey", tokenizer, texts)
    pairs = key_values(multikey)
    assert len({key for key, _ in pairs}) == 4 and all(n in multikey["prompt"] for n in multikey["needles"])
    question = tokenizer.decode(multikey["question_ids"])
    assert [key for key, _ in pairs if key in question] == [pairs[0][0]] and multikey["answers"] == [pairs[0][1]]

    multivalue = key_values(document("niah_multivalue", tokenizer, texts))
    assert len({key for key, _ in multivalue}) == 1 and len({value for _, value in multivalue}) == 4

    multiquery = document("niah_multiquery", tokenizer, texts)
    pairs = key_values(multiquery)
    question = tokenizer.decode(multiquery["question_ids"])
    assert all(key in question for key, _ in pairs) and sorted(multiquery["answers"]) == sorted(v for _, v in pairs)


@pytest.mark.parametrize(("length", "high", "low"), [(2048, 6, 1), (4096, 30, 3)])
def test_common_words_are_the_ten_most_frequent_of_the_list(length, high, low, tokenizer, texts):
    found = document("cwe", tokenizer, texts, length=length, depth=None)
    listing = found["prompt"].rsplit("appear most often.\n", 1)[1].split("\nQuestion:")[0]
    counts = Counter(re.findall(r"\d+\. ([a-z]+)", listing))
    assert len(found["answers"]) == 10
    assert {counts[word] for word in found["answers"]} == {high}
    assert set(counts.values()) == {high, low} and counts.keys() > set(found["answers"])
    assert found["depth"] is None and found["needles"] == []


@pytest.mark.parametrize(
    ("prediction", "answers", "score"),
    [
        ("The special magic numbers are 1234567 and 7654321.", ["1234567", "7654321"], 1.0),
        ("The special magic numbers are 1234567.", ["1234567", "7654321"], 0.5),
        ("they are: abcde, FGHIJ", ["ABCDE", "FGHIJ", "KLMNO"], 2 / 3),
        ("nothing", ["1234567"], 0.0),
        ("12345678", ["1234567"], 1.0),  # RULER's metric is a substring test
    ],
)
def test_string_match_all_is_the_share_of_answers_found_ignoring_case(prediction, answers, score):
    assert longcontext.string_match_all(prediction, answers) == pytest.approx(score)


def test_depths_cycle_over_documents_and_common_words_have_none():
    tasks = task_registry()
    assert [longcontext.depth_of(tasks["niah_single"], i) for i in range(6)] == [0, 25, 50, 75, 100, 0]
    assert longcontext.depth_of(tasks["cwe"], 3) is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"task.length": 10}, "task.length=10: use a prompt length"),
        ({"task.depths": "[0,150]"}, "task.depths=[0, 150]: use a list of needle depths"),
        ({"task.haystack": "/nonexistent.jsonl"}, "no haystack file /nonexistent.jsonl"),
        ({"num_fewshot": 2}, "has no few-shot examples: drop num_fewshot=2"),
    ],
)
def test_bad_settings_stop_with_one_line(overrides, message, tmp_path, data_dir):
    config = make_config(data_dir, tmp_path, model="tiny-llama", task="niah_single", **overrides)
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(config)


def test_a_haystack_without_data_dir_must_be_named(tmp_path):
    config = make_config(None, tmp_path, model="tiny-llama", task="vt")
    with pytest.raises(ConfigError, match=re.escape("set data_dir=PATH (its xsum and cnn_dailymail articles)")):
        validate(config)


def test_any_jsonl_of_texts_is_a_haystack(tmp_path, tokenizer):
    haystack = tmp_path / "essays.jsonl"
    lines = [{"body": f"Essay {i} says many things. It goes on about topic number {i} for a while."} for i in range(40)]
    haystack.write_text("".join(json.dumps(line) + "\n" for line in lines))
    task = {**task_registry()["niah_single"], "haystack": str(haystack), "text_field": "body"}
    texts = longcontext.load_haystack(task, None)
    assert texts == [line["body"] for line in lines]
    found = longcontext.make_document(task, tokenizer, texts, seed=0, index=0, length=900, depth=25)
    assert 896 <= found["length"] <= 900 and "Essay" in found["prompt"]  # short texts are cycled to fill
    with pytest.raises(ConfigError, match="set task.text_field=FIELD"):
        longcontext.load_haystack({**task, "text_field": None}, None)


def test_cli_writes_a_record_and_outputs_with_depths_answers_and_scores(tmp_path, data_dir):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline"}
    args = ["model=tiny-llama", "task=niah_single", "policy=h2o", "budget=0.5", "limit=5", "batch_size=2"]
    args += [f"data_dir={data_dir}", "results_dir=out", "wandb.mode=disabled"]

    def cli(length):
        done = subprocess.run(
            [sys.executable, "-m", "h2o_eval", *args, f"task.length={length}"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    cli(256)
    [path] = (tmp_path / "out").glob("*.json")
    record = json.loads(path.read_text())
    assert record["length"] == 256 and record["protocol"] == "prefill" and record["n_samples"] == 5
    outputs = [json.loads(line) for line in (tmp_path / "out" / record["outputs"]).read_text().splitlines()]
    assert [o["depth"] for o in outputs] == [0, 25, 50, 75, 100]
    for output in outputs:
        assert output["answers"] and all(answer in output["prompt"] for answer in output["answers"])
        assert 252 <= output["prompt_tokens"] <= 256
        score = output["scores"]["string_match_all"]
        assert score == longcontext.string_match_all(output["prediction"], output["answers"])
    per_document = [o["scores"]["string_match_all"] for o in outputs]
    assert record["metrics"]["string_match_all"] == pytest.approx(sum(per_document) / 5)
    assert [o["budget_tokens"] for o in outputs] == [o["prompt_tokens"] for o in outputs]
    kept = record["capacity"]["kept_fraction_mean"]
    assert 0.5 <= kept <= 0.5 + 1 / 252, "h2o at 50 % keeps ceil(0.5 n) of each n-token prompt"
    cli(300)
    assert len(list((tmp_path / "out").glob("*.json"))) == 2, "the length is part of a record's identity"


def test_under_the_context_protocol_a_full_cache_answers_as_under_prefill(tmp_path, data_dir):
    """Contexts are fed first and the question after (batched by question length); with nothing evicted the
    answers are those of the whole prompt at once."""
    settings = {"model": "tiny-llama", "task": "niah_multiquery", "policy": "full", "limit": 6, "batch_size": 3}
    settings |= {"task.length": 320, "task.max_new_tokens": 8}
    prefill = run(make_config(data_dir, tmp_path / "prefill", **settings, protocol="prefill"))
    context = run(make_config(data_dir, tmp_path / "context", **settings, protocol="context"))
    assert context["protocol"] == "context" and context["n_samples"] == 6

    def outputs(record, folder):
        return [json.loads(line) for line in (folder / record["outputs"]).read_text().splitlines()]

    answered = [(o["id"], o["prediction"]) for o in outputs(context, tmp_path / "context")]
    budgeted = [o["budget_tokens"] for o in outputs(context, tmp_path / "context")]
    assert budgeted == [o["context_tokens"] for o in outputs(context, tmp_path / "context")]
    assert context["capacity"]["kept_fraction_mean"] == prefill["capacity"]["kept_fraction_mean"] == 1.0
    assert answered == [(o["id"], o["prediction"]) for o in outputs(prefill, tmp_path / "prefill")]
    assert len({o["prompt_tokens"] - o["context_tokens"] for o in outputs(context, tmp_path / "context")}) > 1


def test_a_length_beyond_the_models_positions_stops_with_one_line(tmp_path, data_dir):
    config = make_config(data_dir, tmp_path, model="tiny-llama", task="niah_single", limit=1, **{"task.length": 2000})
    with pytest.raises(ConfigError, match=re.escape("exceeds tiny-llama's 2048 positions: use task.length <= 1920")):
        run(config)
