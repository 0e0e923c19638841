"""protocol=turns: a document's questions as the turns of one conversation over one cache, proven against
independent paths: one plain forward over the conversation, the multi-request protocol, and the cache's own state."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_config
from transformers import DynamicCache

from h2o_eval import load_model, make_policy, plot
from h2o_eval.cache import EvictionCache
from h2o_eval.errors import ConfigError
from h2o_eval.generation import Cell, Document, Settings, Turns, answer, answering, passes
from h2o_eval.grid import compose, preset_sweep
from h2o_eval.names import expand
from h2o_eval.run import check_turns, run, validate
from h2o_eval.runners import long_context

NEW = 6


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load_model("tiny-llama", device="cpu")
    return model, tokenizer


def document(seed: int = 0, turns: int = 3) -> Document:
    """A context and ``turns`` questions, gold answers and an end of turn, as random token ids."""
    generator = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(5, 250, (n,), generator=generator).tolist()

    return Document(ids(60), [ids(5) for _ in range(turns)], [ids(4) for _ in range(turns)], ids(2))


def settings(history: str, schedule: str, decoding: str = "grow") -> Settings:
    return Settings(max_new_tokens=NEW, batch_size=1, decoding=decoding, turns=Turns(history, schedule))


@pytest.fixture
def recorded(monkeypatch):
    """Each turn's decode as the conversation runs it: the cache it answers from, as it was before (its held
    positions and keys per layer), and the logits of the turn's first forward."""
    turns = []

    def decode(model, cache, ids, mask, **kwargs):
        before = [(layer.position.clone(), layer.keys.clone()) for layer in cache.layers]
        out = passes.decode(model, cache, ids, mask, output_logits=True, return_dict_in_generate=True, **kwargs)
        turns.append({"ids": ids, "cache": before, "logits": out.logits[0][0], "sequences": out.sequences})
        return out.sequences

    monkeypatch.setattr(answering, "decode", decode)
    return turns


def conversation_ids(doc: Document, k: int) -> list[int]:
    """The gold conversation up to turn ``k``'s question: context, then each earlier question and gold answer."""
    ids = list(doc.context)
    for j in range(k):
        ids += doc.questions[j] + doc.answers[j]
    return ids + doc.questions[k]


@torch.no_grad()
def test_full_cache_with_gold_history_equals_one_forward_over_the_conversation(tiny, recorded):
    model, tokenizer = tiny
    doc = document()
    answer(model, tokenizer, [Cell(make_policy("full", 1.0), "turns")], [doc], settings("gold", "once"))
    assert len(recorded) == len(doc.questions)
    for k, turn in enumerate(recorded):
        ids = conversation_ids(doc, k)
        assert turn["ids"][0].tolist() == ids
        plain = model(torch.tensor([ids])).logits[0, -1]
        torch.testing.assert_close(turn["logits"], plain, atol=2e-5, rtol=0)
        greedy = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        assert turn["sequences"][0, : greedy.shape[1]].tolist() == greedy[0].tolist()


@torch.no_grad()
def test_own_history_holds_exactly_the_generated_tokens(tiny, recorded):
    model, tokenizer = tiny
    doc = document(1)
    answer(model, tokenizer, [Cell(make_policy("full", 1.0), "turns")], [doc], settings("own", "once"))
    for k in range(1, len(doc.questions)):
        generated = recorded[k - 1]["sequences"][0].tolist()  # the earlier turn's prompt and the model's answer
        closing = doc.end[1:] if generated[-1] == doc.end[0] else doc.end
        held = generated + closing
        assert recorded[k]["ids"][0].tolist() == held + doc.questions[k]
        plain = DynamicCache(config=model.config)
        model(torch.tensor([held]), cache=plain, use_cache=True)
        for (position, keys), expected in zip(recorded[k]["cache"], plain.layers, strict=True):
            assert position[0, 0].tolist() == list(range(len(held)))
            torch.testing.assert_close(keys, expected.keys, atol=2e-5, rtol=0)


def held_entries(cache: EvictionCache) -> list[dict[int, tuple]]:
    """Per layer and KV head of a one-sequence cache: each held token's position -> (key, value, score)."""
    found = []
    for layer in cache.layers:
        slots = layer.slots.dense()
        for head in range(slots.held.shape[1]):
            held = slots.held[0, head].nonzero().flatten().tolist()
            found.append(
                {
                    int(slots.position[0, head, s]): (
                        slots.keys[0, head, s],
                        slots.values[0, head, s],
                        slots.scores[0, head, s],
                    )
                    for s in held
                }  # fmt: skip
            )
    return found


@pytest.mark.parametrize("policy", ["h2o", "knorm", "keydiff", "tova"])  # tova: its preset heads=layer
@pytest.mark.parametrize("history", ["gold", "own"])
@torch.no_grad()
def test_new_turn_leaves_the_earlier_turns_untouched_and_nested_does_not(tiny, monkeypatch, policy, history):
    model, tokenizer = tiny
    compressions = []
    compress_turn = EvictionCache.compress_turn

    def watched(cache, schedule):
        start = int(cache.turn_start.flatten()[0])
        before = held_entries(cache)
        compress_turn(cache, schedule)
        compressions.append((schedule, start, before, held_entries(cache)))

    monkeypatch.setattr(EvictionCache, "compress_turn", watched)
    built = make_policy(policy, 0.5, **({"heads": "layer"} if policy == "tova" else {}))
    for schedule in ("new_turn", "nested"):
        cells = [Cell(built, "turns")]
        answer(model, tokenizer, cells, [document(2, turns=4)], settings(history, schedule))
    assert [c[0] for c in compressions] == ["new_turn"] * 3 + ["nested"] * 3
    older_dropped = 0
    for schedule, start, before, after in compressions:
        for held, kept in zip(before, after, strict=True):
            new = [p for p in held if p >= start]
            older = [p for p in held if p < start]
            candidates = len(new) if schedule == "new_turn" else len(held)
            assert len(kept) == len(held) - candidates + built.capacity(candidates)  # the candidates, halved
            if schedule == "new_turn":
                assert [p for p in kept if p < start] == older
                for p in older:
                    assert all(torch.equal(a, b) for a, b in zip(held[p], kept[p], strict=True))
            else:
                older_dropped += len(older) - len([p for p in kept if p < start])
    assert older_dropped > 0  # nested compresses what earlier turns left, new_turn never does


@pytest.mark.parametrize("policy", ["snapkv", "h2o", "full"])
@torch.no_grad()
def test_once_with_grow_equals_the_multi_request_first_question(tiny, policy):
    model, tokenizer = tiny
    docs = [document(3), document(4)]
    built = make_policy(policy, 0.5)
    together = Settings(max_new_tokens=NEW, batch_size=1, decoding="grow")
    requests = answer(model, tokenizer, [Cell(built, "context")], docs, together)[0]
    turns = answer(model, tokenizer, [Cell(built, "turns")], docs, settings("gold", "once"))[0]
    first = {d: g["tokens"] for d, k, g in requests.rows if k == 0}
    assert {d: g["tokens"] for d, k, g in turns.rows if k == 0} == first
    assert len(turns.rows) == len(requests.rows) == 6


def test_cells_that_share_the_context_pass_answer_as_alone(tiny):
    model, tokenizer = tiny
    docs = [document(5)]
    cells = [Cell(make_policy("h2o", 0.5), "turns"), Cell(make_policy("knorm", 0.25), "turns")]
    together = answer(model, tokenizer, cells, docs, settings("own", "nested"))
    for cell, shared in zip(cells, together, strict=True):
        alone = answer(model, tokenizer, [cell], docs, settings("own", "nested"))[0]
        assert [g["tokens"] for *_, g in shared.rows] == [g["tokens"] for *_, g in alone.rows]


@pytest.mark.parametrize("schedule", ["once", "nested", "new_turn"])
def test_stacked_cells_answer_each_turn_as_alone(tiny, schedule):
    model, tokenizer = tiny
    docs = [document(6), document(7, turns=4)]
    cells = [
        Cell(make_policy(name, budget), "turns") for name, budget in [("full", 1.0), ("h2o", 0.5), ("knorm", 0.25)]
    ]
    if schedule == "once":
        cells.append(Cell(make_policy("oracle", 0.5), "turns"))
    stacked = Settings(max_new_tokens=NEW, batch_size=1, decoding="grow", stack=True, turns=Turns("gold", schedule))
    together = answer(model, tokenizer, cells, docs, stacked)
    for cell, shared in zip(cells, together, strict=True):
        alone = answer(model, tokenizer, [cell], docs, settings("gold", schedule))[0]
        assert [(d, k, g["tokens"]) for d, k, g in shared.rows] == [(d, k, g["tokens"]) for d, k, g in alone.rows]
        assert [g["evicted_tokens"] for *_, g in shared.rows] == [g["evicted_tokens"] for *_, g in alone.rows]


def config(**turns) -> dict:
    return {"turns": {"history": "gold", "schedule": "once"} | turns, "task": {"questions": 4}}


@pytest.mark.parametrize(
    ("settings_", "policy", "runner", "message"),
    [
        (config(history="mine"), "h2o", "long_context", "turns.history='mine': use one of gold, own"),
        (config(schedule="each"), "h2o", "long_context", "turns.schedule='each': use one of once, nested, new_turn"),
        (config(order=1), "h2o", "long_context", "turns takes no order: its settings are history, schedule"),
        ({**config(), "task": {"questions": 1}}, "h2o", "long_context", "needs two questions or more"),
        (config(), "h2o", "lm_eval", "protocol=turns asks a RULER-style task's questions"),
        (config(schedule="nested"), "kvzip", "long_context", "turns.schedule=nested: policy 'kvzip' scores"),
        (config(schedule="new_turn"), "oracle", "long_context", "turns.schedule=new_turn: policy 'oracle'"),
    ],
)
def test_bad_turns_settings_get_one_line_naming_the_fix(settings_, policy, runner, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
        check_turns(settings_, make_policy(policy, 0.5), runner)
    assert "\n" not in str(error.value)


def test_integer_budgets_are_refused_for_turn_compressions():
    with pytest.raises(ConfigError, match="use a fractional budget"):
        check_turns(config(schedule="nested"), make_policy("h2o", 64), "long_context")
    check_turns(config(), make_policy("h2o", 64), "long_context")  # once compresses the context alone


def test_scbench_rows_become_the_conversation_its_chat_template_renders(tiny):
    _, tokenizer = tiny
    row = {
        "id": 0,
        "context": "The key 8f2a holds the value 1234. The key 77c0 holds 9876.",
        "multi_turns": [
            {"input": "What does 8f2a hold?", "answer": "1234"},
            {"input": "And 77c0?", "answer": ["9876"]},
        ],
    }
    doc = long_context.scbench_conversation(tokenizer, row)
    messages = [
        {"role": "user", "content": row["context"] + "\n\n" + "What does 8f2a hold?"},
        {"role": "assistant", "content": "1234"},
        {"role": "user", "content": "And 77c0?"},
        {"role": "assistant", "content": "9876"},
    ]
    pieces = doc.context + doc.questions[0] + doc.answers[0] + doc.questions[1] + doc.answers[1]
    assert tokenizer.chat_template
    assert tokenizer.decode(pieces) == tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokenizer.decode(doc.end) == tokenizer.decode(doc.answers[1]).removeprefix("9876")


def test_records_score_each_turn_and_plot_by_turn_reads_them(tmp_path, data_dir):
    settings_ = {"task.length": 700, "task.max_new_tokens": 4, "task.questions": 3, "protocol": "turns"}
    records = []
    for policy, budget, schedule in [("full", 1.0, "nested"), ("h2o", 0.5, "nested"), ("h2o", 0.5, "new_turn")]:
        config = make_config(
            data_dir, tmp_path, model="tiny-llama", task="niah_single_1", limit=2, policy=policy, budget=budget,
            decoding="grow", **settings_, **{"turns.schedule": schedule},
        )  # fmt: skip
        records.append(run(config))
    record = records[1]
    assert "turns-gold-nested-grow" in next(tmp_path.glob("*h2o*nested*.json")).name
    rows = [json.loads(line) for line in (tmp_path / record["outputs"]).read_text().splitlines()]
    assert [row["turn"] for row in rows] == [1, 2, 3, 1, 2, 3]
    for k in (1, 2, 3):
        scored = [row["scores"]["string_match_all"] for row in rows if row["turn"] == k]
        assert record["metrics"][f"string_match_all_turn{k}"] == pytest.approx(sum(scored) / 2)
        assert record["metrics"][f"string_match_all_turn{k}_n"] == 2
        assert all(row["scores"][f"string_match_all_turn{k}"] is None for row in rows if row["turn"] != k)
    plot.main([str(tmp_path), "--by", "turn", "--out", str(tmp_path / "plots")])
    table = (tmp_path / "plots" / "turns.md").read_text()
    for history, schedule, policy in [
        ("gold", "nested", "full"),
        ("gold", "nested", "h2o"),
        ("gold", "new_turn", "h2o"),
    ]:
        assert f"| {history} | {schedule} | {policy} |" in table
    assert (tmp_path / "plots" / "turns.pdf").stat().st_size > 0
    paired = (tmp_path / "plots" / "paired_turns.md").read_text()
    for turn in (1, 2, 3):
        assert f"| {turn} | gold | nested | h2o | 0.5 | 1 | 2 |" in paired


def test_every_cell_of_the_preset_is_valid(data_dir, tmp_path):
    overrides = ["+experiment=kv_multiturn", "model=smollm2-135m", "task=niah_single_2", f"data_dir={data_dir}"]
    cells = expand(preset_sweep([*overrides, f"results_dir={tmp_path}"]))
    specs = [validate(compose(cell)) for cell in cells]
    assert len(specs) == 13 * 2 * 2 * 2
    assert {(s.config["turns"]["history"], s.config["turns"]["schedule"]) for s in specs} == {
        (history, schedule) for history in ("gold", "own") for schedule in ("nested", "new_turn")
    }
    assert all(s.config["stack_cells"] and s.config["protocol"] == "turns" for s in specs)
