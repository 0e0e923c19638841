"""RULER's thirteen tasks (h2o_eval/ruler/) checked on generated documents, with Llama-3's tokenizer (kvpress's
fit) or SmolLM2's, no model weights. The strongest check is the first: documents equal RULER e40fae1's own output,
run offline with the same tokenizer and data (its samples' hashes are recorded here)."""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections import Counter
from importlib import resources

import pytest
import yaml
from scipy.stats import chisquare

from h2o_eval import ruler
from h2o_eval.data import read_jsonl
from h2o_eval.errors import ConfigError
from h2o_eval.models import smollm2_tokenizer
from h2o_eval.ruler import sources, tasks
from h2o_eval.runners import task_registry

# sha256 (first 16 hex digits) of json.dumps([input, outputs]) of samples 0-2 that RULER e40fae1's prepare.py wrote
# for each task (Llama-3 tokenizer, hf, max_seq_length 4096, base template, seed 42), with shared/data's essays,
# SQuAD dev half (chrischute/squad's dev-v2.0.json, the source of squad_v2/validation.jsonl) and HotpotQA rows.
RULER_SAMPLES = {
    "niah_single_1": ["6c6da03dee0f5a44", "2baa4ca6d26a3ee8", "708593cabac7f802"],
    "niah_single_2": ["2a3530a33a57604b", "399b157ca5ccd455", "396a3aa976a0b508"],
    "niah_single_3": ["fc088c55cc7dd1bd", "5bcbbc1f92c1df91", "37267caed6d99863"],
    "niah_multikey_1": ["b0afa29ab7f618df", "28c665dbb1f8ee72", "eb77863f0c3aa103"],
    "niah_multikey_2": ["d82cfe973a7a13f7", "997cc2e7ed992258", "8adc2c00f3062b5f"],
    "niah_multikey_3": ["843441a83aeb9ea1", "71359b433ef303b0", "46045943b92597d2"],
    "niah_multivalue": ["ff7dd8fa5c3ac9b2", "259856e504504995", "0b69e97d3ce429bb"],
    "niah_multiquery": ["f0d3dd4409fab693", "87670a0171193eae", "7f60e2bc78a6936a"],
    "vt": ["942ea0a111a74aba", "dc439cd548ef1d11", "5929ded89eb5bc1f"],
    "cwe": ["9ba432a0bb566f10", "6eb639d4ecf2f6e1", "2f9ead93b45879a2"],
    "fwe": ["39d7bd8b92066c83", "2b93ab8663a109a2", "a007bb9a1af586e2"],
    "qa_1": ["18e482a6bd7dc5fd", "da4ed6b3a2c26b5f", "c377c7f620ee2038"],
    "qa_2": ["b8058835e116dcba", "f74c994b1ca168a0", "274d0eb6d1c84d26"],
}
# RULER's lengths (its "length" field: input + tokens to generate) of those samples 0.
RULER_LENGTHS = {
    "niah_single_1": 3799,
    "niah_single_2": 3888,
    "niah_single_3": 3902,
    "niah_multikey_1": 3936,
    "niah_multikey_2": 3797,
    "niah_multikey_3": 3181,
    "niah_multivalue": 3934,
    "niah_multiquery": 3963,
    "vt": 3867,
    "cwe": 3837,
    "fwe": 3927,
    "qa_1": 2596,
    "qa_2": 2609,
}
UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")
NUMBER = re.compile(r"^\d{7}$")
NEEDLE_LINE = re.compile(r"^One of the special magic (numbers|uuids) for (.+) is: (\S+)\.$")


def task(name: str, **overrides) -> dict:
    """The task as its YAML gives it, fitted with Llama-3's tokenizer unless overridden."""
    return {**task_registry()[name], "fit_tokenizer": "llama3", **overrides}


def documents(name: str, data_dir, limit: int = 3, **overrides) -> list[dict]:
    config = task(name, **overrides)
    return ruler.generate(config, count_tokens=ruler.fit_counter(config, None), data_dir=data_dir, limit=limit)


def full_input(document: dict, question: int = 0) -> str:
    asked = document["questions"][question]
    return document["context"] + asked["question"] + asked["answer_prefix"]


@pytest.fixture(scope="module")
def adjectives_nouns():
    return sources.wonderwords("adjectivelist.txt"), sources.wonderwords("nounlist.txt")


@pytest.mark.parametrize("name", ruler.TASKS)
def test_documents_are_rulers_own_samples_byte_for_byte(name, data_dir):
    """Context + question + answer prefix and the references equal RULER e40fae1's samples 0-2, and fit_tokens is
    RULER's measured length less the tokens to generate (RULER's generator run offline, hashes above)."""
    found = documents(name, data_dir)
    digests = [
        hashlib.sha256(json.dumps([full_input(d), d["questions"][0]["outputs"]]).encode()).hexdigest()[:16]
        for d in found
    ]
    assert digests == RULER_SAMPLES[name]
    assert found[0]["fit_tokens"] + found[0]["max_new_tokens"] == RULER_LENGTHS[name]


def test_the_thirteen_tasks_and_their_yaml_carry_rulers_parameters():
    assert list(ruler.TASKS) == [
        *("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2"),
        *("niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2"),
    ]
    generic = {"runner": "long_context", "length": 4096, "fit_tokenizer": "model", "seed": 42, "depths": None}
    generic |= {"questions": 1, "haystack": None, "text_field": None}
    for name, parameters in ruler.TASKS.items():
        loaded = task_registry()[name]
        assert loaded == {"name": name, "samples": 100 if name == "qa_2" else 500, **generic, **parameters}
        assert set(parameters) == {"family", "max_new_tokens", "metric", *tasks.PARAMETERS[parameters["family"]]}
    new_tokens = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}
    for spec in ruler.TASKS.values():
        assert spec["max_new_tokens"] == new_tokens[spec["family"]]
        assert spec["metric"] == ("string_match_part" if spec["family"] == "qa" else "string_match_all")


@pytest.mark.parametrize("name", ruler.TASKS)
def test_the_cut_puts_the_question_and_answer_prefix_where_kvpress_puts_them(name, data_dir):
    """The question starts at the last match of kvpress's pattern, the answer prefix at its answer pattern, and the
    context keeps everything before (solved examples included); the pieces join into the input unchanged."""
    family = ruler.TASKS[name]["family"]
    for document in documents(name, data_dir):
        asked = document["questions"][0]
        text = full_input(document)
        assert ruler.split_input(family, text) == (document["context"], asked["question"], asked["answer_prefix"])
        assert tasks.QUESTION_PATTERNS[family].match(asked["question"])
        assert tasks.ANSWER_PATTERNS[family].match(asked["answer_prefix"])
        assert not tasks.QUESTION_PATTERNS[family].search(asked["question"][1:] + asked["answer_prefix"])
        if family in ("niah", "vt", "cwe", "fwe"):
            assert document["context"].endswith("\n")
        assert asked["question"].endswith(" ")


def test_singular_wording_exactly_when_one_value_is_asked(data_dir):
    for name in ruler.TASKS:
        spec = ruler.TASKS[name]
        if spec["family"] != "niah":
            continue
        document = documents(name, data_dir, limit=1)[0]
        asked = document["questions"][0]
        kind = spec["type_needle_v"]
        queries = (
            asked["question"].removeprefix("What is the special magic ").removeprefix("What are all the special magic ")
        )
        if spec["num_needle_q"] * spec["num_needle_v"] == 1:
            one = kind[:-1]
            assert document["context"].startswith(
                f"A special magic {one} is hidden within the following text. Make sure to memorize it. I will quiz "
                f"you about the {one} afterwards.\n"
            )
            key = queries.removeprefix(f"{one} for ").removesuffix(" mentioned in the provided text? ")
            assert asked["question"] == f"What is the special magic {one} for {key} mentioned in the provided text? "
            assert asked["answer_prefix"] == f"The special magic {one} for {key} mentioned in the provided text is"
        else:
            assert document["context"].startswith(f"Some special magic {kind} are hidden within the following text.")
            assert asked["question"].startswith(f"What are all the special magic {kind} for ")
            assert asked["answer_prefix"].endswith(" mentioned in the provided text are")


def test_the_other_families_use_rulers_templates(data_dir):
    vt = documents("vt", data_dir, limit=1)[0]
    value = vt["questions"][0]["question"].split()[-5]
    assert vt["context"].startswith(" Memorize and track the chain(s) of variable assignment hidden in the following")
    assert vt["questions"][0] == {
        "question": f"Question: Find all variables that are assigned the value {value} in the text above. ",
        "answer_prefix": "Answer: According to the chain(s) of variable assignment in the text above, 5 variables "
        f"are assgined the value {value}, they are: ",
        "outputs": vt["questions"][0]["outputs"],
        "depths": vt["questions"][0]["depths"],
    }
    cwe = documents("cwe", data_dir, limit=1)[0]
    assert cwe["context"].startswith("Below is a numbered list of words. In these words, some appear more often")
    assert cwe["context"].count("Question: What are the 10 most common words in the above list?") == 1  # the example
    assert cwe["questions"][0]["question"] == "Question: What are the 10 most common words in the above list? "
    assert cwe["questions"][0]["answer_prefix"] == "Answer: The top 10 words that appear most often in the list are:"
    fwe = documents("fwe", data_dir, limit=1)[0]
    assert fwe["questions"][0]["question"] == (
        "Question: Do not provide any explanation. Please ignore the dots '....'. What are the three most frequently "
        "appeared words in the above coded text? "
    )
    assert fwe["questions"][0]["answer_prefix"] == (
        "Answer: According to the coded text above, the three most frequently appeared words are:"
    )
    qa = documents("qa_1", data_dir, limit=1)[0]
    assert qa["context"].startswith("Answer the question based on the given documents. Only give me the answer and do")
    assert qa["questions"][0]["question"].startswith(
        "Answer the question based on the given documents. Only give me the answer and do not output any other "
        "words.\n\nQuestion: "
    )
    assert qa["questions"][0]["answer_prefix"] == "Answer:"


@pytest.mark.parametrize(
    ("name", "haystack", "needles", "asked", "keys", "values"),
    [
        ("niah_single_1", "repeat", 1, 1, None, NUMBER),
        ("niah_single_2", "essay", 1, 1, None, NUMBER),
        ("niah_single_3", "essay", 1, 1, None, UUID),
        ("niah_multikey_1", "essay", 4, 1, None, NUMBER),
        ("niah_multikey_2", "needle", 1, 1, None, NUMBER),
        ("niah_multikey_3", "needle", 1, 1, UUID, UUID),
        ("niah_multivalue", "essay", 4, 4, None, NUMBER),
        ("niah_multiquery", "essay", 4, 4, None, NUMBER),
    ],
)
def test_needles_keys_values_and_haystacks_are_rulers(
    name, haystack, needles, asked, keys, values, data_dir, adjectives_nouns
):
    """Keys are adjective-noun pairs (or UUIDs), values 7-digit numbers or UUIDs; each asked needle is in the
    context once; the haystack is the first N essay words, N noise lines, or N distractor needles."""
    adjectives, nouns = set(adjectives_nouns[0]), set(adjectives_nouns[1])
    kind = ruler.TASKS[name]["type_needle_v"]
    essay = sources.words_of(data_dir / sources.ESSAYS, "text")
    for document in documents(name, data_dir):
        context = document["context"].split("\n", 1)[1]
        asked_values = document["questions"][0]["outputs"]
        assert len(asked_values) == asked and all(values.match(value) for value in asked_values)
        found = re.findall(rf"One of the special magic {kind} for (.+?) is: (\S+)\.", context)
        if haystack == "needle":
            lines = context.rstrip("\n").split("\n")
            assert all(NEEDLE_LINE.match(line) for line in lines) and len(lines) == document["haystack_units"] + 1
            assert len(found) == document["haystack_units"] + 1
        else:
            assert len(found) == needles
        for key, _ in found:
            if keys is None:
                assert any(key.startswith(a + "-") and key[len(a) + 1 :] in nouns for a in adjectives), key
            else:
                assert keys.match(key)
        for value in asked_values:
            assert sum(v == value for _, v in found) == 1
        bare = context
        for key, value in found:
            bare = bare.replace(f"One of the special magic {kind} for {key} is: {value}.", "")
        if haystack == "essay":
            assert document["haystack_units"] == 3000
            # RULER rejoins Punkt's sentences with spaces ("good.[2]" becomes "good. [2]"): compare without spaces
            assert "".join(bare.split()) == "".join(essay[:3000])
            assert bare.lstrip().startswith("July 2010What hard liquor, cigarettes, heroin, and crack")
        elif haystack == "repeat":
            assert document["haystack_units"] == 150
            assert [line for line in bare.split("\n") if line] == [tasks.NOISE] * 150


def test_the_distractor_haystacks_have_rulers_sizes_at_4k(data_dir):
    """The needle haystacks hold as many distractor needles as kvpress's dataset: 200 with word keys, 50 with UUIDs
    (the 25-line step); every key differs from the asked one."""
    for name, units in [("niah_multikey_2", 200), ("niah_multikey_3", 50)]:
        for document in documents(name, data_dir):
            assert document["haystack_units"] == units
            key = document["questions"][0]["question"].split(" for ")[1].split(" mentioned")[0]
            lines = document["context"].rstrip("\n").split("\n")[1:]
            assert [NEEDLE_LINE.match(line)[2] for line in lines].count(key) == 1


def test_essay_depths_are_drawn_uniformly_from_rulers_forty(data_dir):
    """A chi-square goodness-of-fit over 400 documents: the asked needle's depth is uniform over RULER's 40 depths
    (as random.sample draws it), and multikey's four needles never share a depth."""
    assert [round(100 * i / 39) for i in range(40)] == tasks.DEPTHS
    found = [d["questions"][0]["depths"][0] for d in documents("niah_single_2", data_dir, limit=400, length=1024)]
    counts = Counter(found)
    assert set(counts) <= set(tasks.DEPTHS)
    assert chisquare([counts[depth] for depth in tasks.DEPTHS]).pvalue > 0.001
    grid = [
        d["questions"][0]["depths"][0]
        for d in documents("niah_single_2", data_dir, limit=400, length=1024, depths=[0, 25, 50, 75, 100])
    ]
    assert chisquare([Counter(grid)[depth] for depth in tasks.DEPTHS]).pvalue < 1e-6
    for document in documents("niah_multiquery", data_dir, limit=20, length=2048):
        assert len(set(document["questions"][0]["depths"])) == 4


@pytest.mark.parametrize("name", ruler.TASKS)
def test_lengths_fit_the_limit_within_one_fitting_step(name, data_dir):
    """RULER's rule: input with answer prefix plus the tokens to generate fit the length (fwe at e40fae1: the input
    alone), and one more haystack step would not (the step's own tokens bound the gap)."""
    config = task(name)
    count = ruler.fit_counter(config, None)
    step = {
        "repeat": count("\n".join([tasks.NOISE] * 25)),
        "essay": count(" ".join(sources.words_of(data_dir / sources.ESSAYS, "text")[:500])),
        "needle": 25
        * count(
            "\nOne of the special magic uuids for 00000000-0000-4000-8000-000000000000 is: "
            "00000000-0000-4000-8000-000000000000."
        ),
    }.get(config.get("type_haystack"))
    for document in documents(name, data_dir):
        fit = document["fit_tokens"]
        if name == "fwe":
            assert 4096 - 500 < fit <= 4096
            continue
        assert fit + config["max_new_tokens"] <= 4096
        if step is not None:
            assert fit + config["max_new_tokens"] + step > 4096


def test_the_model_tokenizer_fits_as_ruler_does_with_it(data_dir):
    """fit_tokenizer=model counts with the model's own tokenizer (no special tokens), so SmolLM2's digit-splitting
    tokenizer gets a shorter haystack than Llama-3's, each document within the length."""
    tokenizer = smollm2_tokenizer()
    config = task("niah_multikey_2", fit_tokenizer="model")
    count = ruler.fit_counter(config, tokenizer)
    assert count is ruler.fit_counter(config, tokenizer)
    assert count("1234567 is a number") == len(tokenizer.encode("1234567 is a number", add_special_tokens=False))
    found = ruler.generate(config, count_tokens=count, data_dir=data_dir, limit=3)
    for document in found:
        assert count(full_input(document)) == document["fit_tokens"] <= 4096 - 128
        assert document["haystack_units"] < 200


@pytest.mark.parametrize("name", ["qa_1", "qa_2"])
def test_qa_documents_hold_their_gold_paragraphs(name, data_dir):
    dataset = ruler.TASKS[name]["dataset"]
    rows = read_jsonl(data_dir / sources.DATASETS[dataset])
    if dataset == "squad":
        rows = [row for row in rows if row["answers"]["text"]]
    for index, document in enumerate(documents(name, data_dir, limit=5)):
        row = rows[index]
        if dataset == "squad":
            gold = [row["context"]]
            assert document["questions"][0]["outputs"] == row["answers"]["text"]
        else:
            gold = [
                f"{t}\n{''.join(s)}" for t, s in zip(row["context"]["title"], row["context"]["sentences"], strict=True)
            ]
            assert document["questions"][0]["outputs"] == [row["answer"]]
        assert document["questions"][0]["question"].endswith(f"Question: {row['question']} ")
        for paragraph in gold:
            assert re.search(r"\nDocument \d+:\n" + re.escape(paragraph) + "\n\n", document["context"])
        assert len(re.findall(r"(?m)^Document \d+:$", document["context"])) == document["haystack_units"]


def test_k_questions_share_one_context_with_distinct_keys_at_spread_depths(data_dir):
    """questions=4 on niah_single_2: four groups of one needle, four distinct keys each asked by its own question,
    at four distinct depths, one in each quarter of RULER's 40 depths."""
    for document in documents("niah_single_2", data_dir, limit=10, questions=4):
        questions = document["questions"]
        keys = [q["answer_prefix"].split(" for ")[1].split(" mentioned")[0] for q in questions]
        assert len(set(keys)) == 4
        assert document["context"].startswith("Some special magic numbers are hidden within the following text.")
        for question, key in zip(questions, keys, strict=True):
            assert (
                question["question"] == f"What is the special magic number for {key} mentioned in the provided text? "
            )
            (value,) = question["outputs"]
            assert document["context"].count(f"One of the special magic numbers for {key} is: {value}.") == 1
        depths = [q["depths"][0] for q in questions]
        quarters = sorted(tasks.DEPTHS.index(depth) // 10 for depth in depths)
        assert quarters == [0, 1, 2, 3]
        assert document["fit_tokens"] == max(
            ruler.fit_counter(task("niah_single_2"), None)(full_input(document, k)) for k in range(4)
        )


def test_k_questions_on_line_haystacks_vt_and_qa(data_dir):
    for document in documents("niah_multikey_3", data_dir, limit=3, questions=2):
        depths = [q["depths"][0] for q in document["questions"]]
        assert depths[0] != depths[1] and (depths[0] < 50) != (depths[1] < 50)
    for document in documents("vt", data_dir, limit=3, questions=3):
        chains = [q["outputs"] for q in document["questions"]]
        assert len({name for chain in chains for name in chain}) == 15
        for question, chain in zip(document["questions"], chains, strict=True):
            value = question["question"].split()[-5]
            assert f"VAR {chain[0]} = {value}" in document["context"]
            assert all(f"VAR {b} = VAR {a} " in document["context"] for a, b in itertools.pairwise(chain))
    rows = [row for row in read_jsonl(data_dir / sources.DATASETS["squad"]) if row["answers"]["text"]]
    for index, document in enumerate(documents("qa_1", data_dir, limit=3, questions=3)):
        for k, question in enumerate(document["questions"]):
            row = rows[index * 3 + k]
            assert question["question"].endswith(f"Question: {row['question']} ")
            assert re.search(r"\nDocument \d+:\n" + re.escape(row["context"]) + "\n\n", document["context"])


def test_the_depth_grid_places_the_asked_needle_on_it(data_dir):
    grid = [0, 50, 100]
    for index, document in enumerate(documents("niah_single_1", data_dir, limit=6, depths=grid)):
        lines = document["context"].rstrip("\n").split("\n")[1:]
        position = next(i for i, line in enumerate(lines) if line.startswith("One of the special magic"))
        assert document["questions"][0]["depths"] == [grid[index % 3]]
        assert position == {0: 0, 50: 75, 100: 150}[grid[index % 3]]
    for index, document in enumerate(documents("niah_multikey_1", data_dir, limit=4, depths=grid, questions=2)):
        assert [q["depths"] for q in document["questions"]] == [[grid[(2 * index) % 3]], [grid[(2 * index + 1) % 3]]]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"family": "ruler"}, "task.family='ruler': use one of niah, vt, cwe, fwe, qa"),
        ({"type_haystack": "noise"}, "task.type_haystack='noise': use one of repeat, essay, needle"),
        ({"type_needle_v": "letters"}, "task.type_needle_v='letters': use one of numbers, words, uuids"),
        ({"fit_tokenizer": "gpt2"}, "task.fit_tokenizer='gpt2': use one of model, llama3"),
        ({"questions": 0}, "task.questions=0: use an integer >= 1"),
        ({"depths": [0, 120]}, "task.depths=[0, 120]: use null or a list of depths in percent, each in [0, 100]"),
        ({"num_needle_k": 41}, "task niah_single_2 has 41 needles for RULER's 40 essay depths"),
        ({"length": 100}, "task.length=100 leaves no room for the input: use task.length > max_new_tokens"),
    ],
)
def test_bad_niah_settings_are_refused_in_one_line(overrides, message, data_dir):
    with pytest.raises(ConfigError, match=re.escape(message)) as raised:
        ruler.check(task("niah_single_2", **overrides), data_dir)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(
    ("name", "overrides", "message"),
    [
        ("cwe", {"questions": 2}, "task.questions=2: cwe asks one question per context, use questions=1"),
        ("fwe", {"alpha": 1}, "task.alpha=1: use the Zipf exponent, a number > 1"),
        ("vt", {"depths": [50]}, "task.depths=[50]: only needle tasks place needles, use depths=null"),
        ("niah_single_1", {"haystack": "x.jsonl"}, "task.haystack replaces the essay haystack only"),
        ("qa_1", {"dataset": "nq"}, "task.dataset='nq': use one of squad, hotpotqa"),
        ("qa_2", {"samples": 500}, "task qa_2 asks 500 questions (500 documents x 1) of 100 in hotpotqa/validation"),
        ("qa_2", {"questions": 2}, "use limit or task.samples <= 50"),
        ("niah_single_2", {"haystack": "/nonexistent.jsonl"}, "task.haystack=/nonexistent.jsonl does not exist"),
    ],
)
def test_bad_settings_of_other_tasks_are_refused_in_one_line(name, overrides, message, data_dir):
    with pytest.raises(ConfigError, match=re.escape(message)) as raised:
        ruler.check(task(name, **overrides), data_dir)
    assert "\n" not in str(raised.value)


def test_qa_asks_only_the_questions_of_the_documents_a_run_takes(data_dir):
    """Document i asks questions i*K ... i*K+K-1, so a limit of 1 at K=2 needs 2 of HotpotQA's 100 questions,
    whatever task.samples says (a run with a limit used to be refused for task.samples x K)."""
    qa = task("qa_2", questions=2)
    ruler.check(qa, data_dir, 50)
    with pytest.raises(ConfigError, match=re.escape("task qa_2 asks 102 questions (51 documents x 2) of 100")):
        ruler.check(qa, data_dir, 51)
    with pytest.raises(ConfigError, match=re.escape("(100 documents x 2)")):
        ruler.check(qa, data_dir)
    rows = list(read_jsonl(data_dir / sources.DATASETS["hotpotqa"]))
    (document,) = documents("qa_2", data_dir, limit=1, questions=2)
    (fewer,) = documents("qa_2", data_dir, limit=1, questions=2, samples=50)
    assert document == fewer
    assert [rows[k]["question"] in q["question"] for k, q in enumerate(document["questions"])] == [True, True]


def test_data_files_name_what_each_task_reads(data_dir, tmp_path):
    assert ruler.data_files(task("niah_single_2"), data_dir) == [data_dir / sources.ESSAYS]
    assert ruler.data_files(task("qa_1"), data_dir) == [data_dir / "squad_v2/validation.jsonl"]
    assert ruler.data_files(task("qa_2"), data_dir) == [data_dir / "hotpotqa/validation.jsonl"]
    for name in ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "vt", "cwe", "fwe"):
        assert ruler.data_files(task(name), None) == []
    with pytest.raises(ConfigError, match="set data_dir=PATH"):
        ruler.data_files(task("niah_single_2"), None)
    own = tmp_path / "texts.jsonl"
    own.write_text(json.dumps({"body": "First text. "}) + "\n" + json.dumps({"body": "Second one."}) + "\n")
    assert ruler.data_files(task("niah_single_2", haystack=str(own), text_field="body"), None) == [own]


def test_an_own_haystack_replaces_the_essays(tmp_path):
    own = tmp_path / "texts.jsonl"
    sentences = " ".join(f"Sentence number {i} is here." for i in range(400))
    own.write_text(json.dumps({"body": sentences + " "}) + "\n" + json.dumps({"body": "The end."}) + "\n")
    config = task("niah_single_2", haystack=str(own), text_field="body", length=1024)
    (document,) = ruler.generate(config, count_tokens=ruler.fit_counter(config, None), data_dir=None, limit=1)
    assert "Sentence number 0 is here." in document["context"] and "July 2010" not in document["context"]


def test_generate_is_a_prefix_of_longer_runs_and_returns_fresh_copies(data_dir):
    first = documents("niah_single_1", data_dir, limit=2)
    first[0]["questions"][0]["outputs"].append("changed")
    longer = documents("niah_single_1", data_dir, limit=4)
    assert longer[:2] == documents("niah_single_1", data_dir, limit=2)
    assert "changed" not in longer[0]["questions"][0]["outputs"]
    assert [d["index"] for d in longer] == [0, 1, 2, 3]


def test_the_niah_keys_are_rulers_sorted_adjective_noun_pairs(adjectives_nouns):
    """The pair list indexes like sorted(set(f"{adjective}-{noun}")) without building it: checked against the
    built list for tricky lists (hyphenated adjectives, duplicates) and for the real nouns with a slice of the real
    adjectives that includes hyphenated ones."""
    adjectives = ["free", "free-range", "freeze", "a", "a-b", "b", "free"]
    nouns = ["range", "b-c", "zoo", "apple", "zoo", "c"]
    pairs = sources.SortedPairs(adjectives, nouns)
    assert list(pairs) == sorted({f"{a}-{n}" for a in adjectives for n in nouns})
    real_adjectives, real_nouns = adjectives_nouns
    hyphenated = [a for a in real_adjectives if "-" in a]
    roots = {a.split("-")[0] for a in hyphenated}
    chosen = sorted(set(real_adjectives[:40] + hyphenated + [a for a in real_adjectives if a in roots]))
    pairs = sources.SortedPairs(chosen, real_nouns)
    assert list(pairs) == sorted({f"{a}-{n}" for a in chosen for n in real_nouns})
    assert len(sources.adjective_nouns()) == len({a for a in real_adjectives}) * len(set(real_nouns))


def test_wonderwords_is_the_version_ruler_read():
    """wonderwords 3.x dropped four nouns ("abortion", "brocolli", "idiot", "pray"), which moves every key."""
    assert len(sources.wonderwords("nounlist.txt")) == 6786
    assert {"abortion", "brocolli", "idiot", "pray"} <= set(sources.wonderwords("nounlist.txt"))


def test_rulers_metrics_on_hand_made_predictions():
    assert ruler.string_match_all("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert ruler.string_match_all("PARIS", ["paris"]) == 1.0
    assert ruler.string_match_part("It is in France.", ["France", "French Republic"]) == 1.0
    assert ruler.string_match_part("Germany", ["France", "French Republic"]) == 0.0


@pytest.mark.parametrize("name", ruler.TASKS)
def test_every_yaml_key_but_the_name_has_its_comment(name):
    text = (resources.files("h2o_eval.conf") / "task" / f"{name}.yaml").read_text()
    keys = [line for line in text.splitlines() if line and not line.startswith(("#", " "))]
    assert [line.split(":")[0] for line in keys] == list(yaml.safe_load(text))
    assert all(" # " in line for line in keys if not line.startswith("name:"))
