"""``kvpress_compare``: its h2o_eval side runs every press on a tiny model through the public API and keeps
kvpress's int(T (1 - ratio)) tokens; the prompts are worded per press as kvpress's pipeline feeds them; the
comparison counts what differs. kvpress itself is not installed here: the script is run by hand (its table is in
docs/policies.md)."""

from __future__ import annotations

import pytest
import torch

from h2o_eval import load_model
from h2o_eval.benchmarks.kvpress_compare import DELIMITER, PRESSES, _newest_topk, cases, compare, h2o_eval_side

PROMPT = {"context": list(range(100, 160)), "question": list(range(200, 206)), "suffix": [300, 301]}


def test_prompts_are_cut_where_kvpress_compresses_them():
    """Query-agnostic presses compress the context; query-aware ones the question too; FINCH's delimiter sits
    before the question, whose length is the window; presses whose scores tie run again with ties towards the
    newest."""
    made = {(case.press, case.ties): case for case in cases({"p": PROMPT}, list(PRESSES), [0.5])}
    context, question, suffix = PROMPT["context"], PROMPT["question"], PROMPT["suffix"]
    assert (made["cur", "topk"].compressed, made["cur", "topk"].asked) == (context, question + suffix)
    assert (made["chunkkv", "topk"].compressed, made["chunkkv", "topk"].asked) == (context + question, suffix)
    finch = made["finch", "topk"]
    assert finch.compressed == context + [DELIMITER] + question and finch.context == context + question
    assert finch.window == 6 and made["cur", "topk"].window == 0
    assert ("lagkv", "newest") in made and ("compactor", "newest") not in made


def test_every_press_runs_on_a_tiny_model_at_kvpress_kept_count():
    model, _ = load_model("tiny-llama", device="cpu")
    vocabulary = model.config.vocab_size
    for case in cases({"p": PROMPT}, list(PRESSES), [0.25]):
        if case.ties != "topk":
            continue
        found = h2o_eval_side(model, case, 3, stop=-1)
        held = [len(head) for layer in found["kept"] for head in layer]
        tokens = len(case.context)
        if case.press == "chunkkv":  # 4 chunks of 20 (the last of 6, in SnapKV's window): int(4 * 0.75) = 3
            assert held == [2 * 20 + 6] * len(held)
        elif PRESSES[case.press].threshold:  # DMS at the threshold 0.25: every token fed stays in its 128 window
            fed = list(range(tokens + len(case.asked) + 2))  # the prompt, the question and two greedy tokens
            assert held == [tokens] * len(held) and all(head == fed for layer in found["end"] for head in layer)
        elif PRESSES[case.press].decoding in ("size", "ratio"):  # the context whole until decoding compresses it
            assert held == [tokens] * len(held)
        elif case.press in ("adakv_compactor", "adakv_expected_attention"):  # heads share the layer's slots
            assert sum(held) == int(tokens * 0.75) * len(held)
        elif case.press == "composed":  # the second press keeps int(45 * 0.75) of the first's int(60 * 0.75)
            assert held == [int(int(tokens * 0.75) * 0.75)] * len(held)
        elif case.press == "per_layer":  # ratio 0.25 in layer 0, 0.125 in layer 1
            heads = model.config.num_key_value_heads
            assert held == [int(tokens * 0.75)] * heads + [int(tokens * 0.875)] * heads
        else:
            assert held == [int(tokens * 0.75)] * len(held), case.press
        assert len(found["tokens"]) == 3 and found["logits"].shape == (3, vocabulary), case.press


def test_the_comparison_counts_heads_tokens_and_logits_up_to_the_first_different_token():
    mine = {"kept": [[[0, 1], [2]]], "tokens": [5, 6, 7], "logits": torch.tensor([[0.0, 1.0], [2.0, 3.0], [9.0, 9.0]])}
    theirs = {
        "kept": [[[0, 1], [3]]],
        "tokens": [5, 8, 7],
        "logits": torch.tensor([[0.0, 1.5, 4], [2.0, 3.25, 4], [0, 0, 4]]),
    }
    assert compare(mine, theirs) == ("1/2", False, 0.5)  # the third step followed other tokens: not compared


def test_kvpress_ties_can_be_broken_towards_the_newest_token():
    scores = torch.tensor([[1.0, 3.0, 1.0, 3.0, 1.0]])
    assert _newest_topk(scores, 3).indices.tolist() == [[3, 1, 4]]
    assert _newest_topk(-scores, 2, largest=False).indices.tolist() == [[3, 1]]


def test_ruler_prompts_read_the_packages_task_configs_and_word_them_as_kvpress(data_dir):
    """The prompts come from the installed package's task configs (an editable install keeps conf/ beside the
    package), worded as kvpress's pipeline words them: the chat template's user turn holds the context, the question
    and the answer prefix come after it."""
    from h2o_eval.benchmarks.kvpress_compare import ruler_prompts
    from h2o_eval.models import smollm2_tokenizer

    tokenizer = smollm2_tokenizer()
    [(name, prompt)] = ruler_prompts(tokenizer, data_dir, ["qa_1"], 512).items()
    context, question, suffix = (tokenizer.decode(prompt[part]) for part in ("context", "question", "suffix"))
    assert name == "qa_1" and context.startswith("<|im_start|>") and "<|im_start|>user" in context
    assert "?" in question and "<|im_start|>assistant" in suffix and suffix.endswith("Answer:")
    assert sum(len(prompt[part]) for part in ("context", "question", "suffix")) <= 512


def test_reasoning_prompts_are_the_token_ids_the_reasoning_runner_feeds(data_dir, monkeypatch):
    """MATH-500's prompts are what the ``reasoning`` runner feeds (``solve``'s batch, caught before a model runs): a
    space in the chat template's user turn as the context, the problem with the end of the turn and the assistant
    header as the question, nothing after; the decoding presses keep the context and are asked the question."""
    from h2o_eval import generation
    from h2o_eval.benchmarks.kvpress_compare import _task, prompts
    from h2o_eval.data import read_jsonl
    from h2o_eval.models import smollm2_tokenizer
    from h2o_eval.runners.reasoning import data_file, solve

    class Caught(Exception):
        pass

    fed = {}

    def make_batch(contexts, questions, *args, **kwargs):
        fed.update(contexts=contexts, questions=questions)
        raise Caught

    monkeypatch.setattr(generation, "make_batch", make_batch)
    tokenizer = smollm2_tokenizer()
    task = _task("math500")
    config = {"task": task, "generation": {"sample": False}, "batch_size": 3, "protocol": "prefill"}
    problems = read_jsonl(data_file(task, data_dir))[:3]
    with pytest.raises(Caught):
        solve(torch.nn.Linear(1, 1), tokenizer, None, config, problems, None, None)
    made = prompts(tokenizer, data_dir, ["math500"], 1024, 3)
    assert list(made) == ["math500/precalculus/807", "math500/intermediate_algebra/1994", "math500/algebra/2584"]
    assert [prompt["context"] for prompt in made.values()] == fed["contexts"]
    assert [prompt["question"] for prompt in made.values()] == fed["questions"]
    first = made["math500/precalculus/807"]
    assert first["suffix"] == [] and tokenizer.decode(first["context"]).endswith("<|im_start|>user\n ")
    assert tokenizer.decode(first["question"]).startswith("Convert the point $(0,3)$")
    assert tokenizer.decode(first["question"]).endswith("<|im_end|>\n<|im_start|>assistant\n")
    made_cases = cases({"p": first}, ["decoding_knorm"], [0.25])
    assert [(case.compressed, case.asked, case.ties) for case in made_cases] == [
        (first["context"], first["question"], ties) for ties in ("topk", "ordered", "newest")
    ]
