"""The reasoning tasks (MATH-500, AIME 2024/2025, GSM8K): kvpress's scorers reproduced exactly, math-verify's second
score, GSM8K's numbers, and a run through the one generation path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_config

from h2o_eval.errors import ConfigError
from h2o_eval.run import execute, validate
from h2o_eval.runners import reasoning
from h2o_eval.runners.reasoning import classify, final_answer, gsm8k_reference, kvpress_boxed, math_verify, scores


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
    assert nested == {"accuracy": 0.0, "math_verify": 1.0}
    assert scores(task, "so $\\boxed{0.5}$", "\\frac{1}{2}") == {"accuracy": 0.0, "math_verify": 1.0}
    assert scores(task, "so $\\boxed{4}$", "3") == {"accuracy": 0.0, "math_verify": 0.0}
    assert scores(task, "so $\\boxed{3}$", "3") == {"accuracy": 1.0, "math_verify": 1.0}
    assert not math_verify("no answer here", "3")


def test_gsm8k_reads_the_last_box_then_the_last_number_against_the_number_after_the_references_hashes():
    """An answer in a box after a number is the box's: the box first (its last number), else the last number of the
    prediction (lm-eval's flexible-extract)."""
    task = {"scorer": "gsm8k"}
    assert gsm8k_reference("She makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 1,018") == "1018"
    assert final_answer(task, "9 * 2 = 18, so she makes $1,018.") == "1018"
    assert final_answer(task, "no number") is None
    assert final_answer(task, "The answer is \\boxed{18}, checked against 20 eggs.") == "18"
    assert final_answer(task, "first \\boxed{7}, then \\boxed{$1,018} in all, 3 days") == "1018"
    assert final_answer(task, "a box without a number \\boxed{x}, so 12") == "12"
    minerva = {"scorer": "first_boxed", "prompt": "minerva_math"}
    said = "so $x=3$.\nFinal Answer: The final answer is $3$. I hope it is correct."
    assert final_answer(minerva, said) == "$3$" and final_answer({"scorer": "first_boxed"}, said) is None
    assert final_answer(minerva, "so $\\boxed{4}$.\nFinal Answer: The final answer is $3$. I hope") == "4"
    assert scores(task, "She makes $18.", "... #### 18") == {"accuracy": 1.0, "math_verify": 1.0}
    assert scores(task, "18 eggs, then 20", "#### 18")["accuracy"] == 0.0
    assert scores(task, "20 eggs, so \\boxed{18} dollars, 2 days", "#### 18")["accuracy"] == 1.0
    assert scores(task, "I cannot tell", "#### 18") == {"accuracy": 0.0, "math_verify": 0.0}


@pytest.mark.parametrize(
    ("prediction", "tokens", "final", "kind"),
    [
        ("  \n \n", [220, 198] * 8, None, "blank"),  # whitespace to the limit is blank before it is a loop
        ("", [], None, "blank"),
        ("1 2 1 2 1 2", [5, 6, 7, 8] * 4, None, "loop"),  # one 4-gram repeated to the limit
        ("so 1, 2, 3, ...", list(range(16)), "3", "cut"),  # at the limit, no repeated n-gram
        ("so 1 1 1", [9] * 3 + [4, 5] * 6 + [7], None, "cut"),  # a loop that ends before the limit's last token
        ("so \\boxed{3}", [4, 5, 6], "3", "answered"),
        ("I do not know", [4, 5, 6], None, "unanswered"),
    ],
)
def test_a_solution_is_blank_a_loop_cut_answered_or_unanswered(prediction, tokens, final, kind):
    assert classify(prediction, tokens, 16, final) == kind


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


def test_a_reasoning_run_records_its_scores_classes_lengths_and_what_each_problem_evicted_and_when(data_dir, tmp_path):
    """Three GSM8K problems under H2O at a budget of 64 tokens, which the prompt and the solution share (the cache
    stays at 64 while the solution grows): each output scored and classified, the record's means and lengths its
    outputs'. Reference for the evictions: a cache of C = 64 fed p prompt tokens, then one per generated token but the
    last, lets p + g - 1 - C tokens go (none if that is negative), the first at the prompt (p > C) or when the
    token that gives generated token C - p + 1 arrives; implementation: the cache's held slots, watched after each
    forward."""
    config = make_config(data_dir, tmp_path, model="tiny-llama", task="gsm8k", policy="h2o", budget=64, limit=3,
                         **{"task.max_new_tokens": 24})  # fmt: skip
    _, record = execute(validate(config))
    outputs = [json.loads(line) for line in (tmp_path / record["outputs"]).read_text().splitlines()]
    assert [o["id"] for o in outputs] == [0, 1, 2]
    for key in ("accuracy", "math_verify", "answered", "cut", "loop", "blank", "evicted"):
        assert record["metrics"][key] == pytest.approx(sum(o["scores"][key] for o in outputs) / 3)
    assert all(sum(o["scores"][kind] for kind in reasoning.CLASSES) == 1.0 for o in outputs)
    lengths = sorted(o["generated_tokens"] for o in outputs)
    generation = record["generation"]
    assert generation["generated_tokens_median"] == lengths[1]
    assert generation["hit_max_new_tokens"] == pytest.approx(sum(n >= 24 for n in lengths) / 3)
    assert all(o["capacity"] <= 64 for o in outputs) and generation["kv_peak_entries"] <= 64
    starts = []
    for o in outputs:
        fed = o["prompt_tokens"] + o["generated_tokens"] - 1
        assert o["evicted_tokens"] == max(0, fed - 64)
        assert o["evicted_from"] == (None if fed <= 64 else max(0, 64 - o["prompt_tokens"] + 1))
        starts.append(o["evicted_from"])
    assert 0 in starts and any(start and start > 0 for start in starts), (
        "the problems should evict at the prompt and later"
    )
    assert generation["evicted_tokens_mean"] == pytest.approx(sum(o["evicted_tokens"] for o in outputs) / 3)


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


def test_agreement_compares_only_the_full_caches_real_solutions_and_never_counts_blank_pairs_or_loops():
    """Constructed solutions beside the full cache's: a blank pair, a loop pair, a full cache that wrote no answer,
    and real pairs. Agreement is scored only where the full cache's solution is real and answered; the trace scores
    where it is real; the pairs left out are counted, none as agreement."""
    from h2o_eval.runners.reasoning import agreement

    def row(kind, final, tokens):
        return {"class": kind, "final_answer": final, "token_ids": tokens, "scores": {}}

    full = [row("blank", None, [1, 1]), row("loop", None, [2, 3, 2, 3]), row("unanswered", None, [4, 5]),
            row("answered", "7", [6, 7, 8]), row("answered", "9", [6, 7, 9])]  # fmt: skip
    mine = [row("blank", None, [1, 1]), row("loop", None, [2, 3, 2, 3]), row("unanswered", None, [4, 5]),
            row("answered", "7", [6, 7, 8]), row("cut", None, [6, 5, 5])]  # fmt: skip
    counts = agreement({"scorer": "gsm8k", "max_new_tokens": 4}, mine, full)
    assert [o["scores"]["agreement"] for o in mine] == [None, None, None, 1.0, 0.0]
    assert [o["scores"]["same_trace"] for o in mine] == [None, None, 1.0, 1.0, 0.0]
    assert [o["scores"]["first_departure"] for o in mine] == [None, None, 2.0, 3.0, 1.0]
    assert counts == {"first_difference_median": 2.0, "both_blank": 1, "both_loop": 1, "full_not_real": 2,
                      "full_unanswered": 1}  # fmt: skip


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
    assert full["metrics"]["same_trace"] == 1.0 and full["metrics"].get("agreement", 1.0) == 1.0
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
    real = [(a, b) for a, b in zip(mine, theirs, strict=True) if b["class"] not in ("blank", "loop")]
    departures = []
    for a, b in real:
        same = [x == y for x, y in zip(a["token_ids"], b["token_ids"], strict=False)]
        departures.append(same.index(False) if False in same else min(len(a["token_ids"]), len(b["token_ids"])))
    answered = [(a, b) for a, b in real if b["final_answer"] is not None]
    if answered:
        assert read["metrics"]["agreement"] == pytest.approx(
            statistics.fmean(a["final_answer"] == b["final_answer"] for a, b in answered)
        )
    assert read["metrics"]["agreement_n"] == len(answered) and read["metrics"]["same_trace_n"] == len(real)
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
    threshold, budgets of 64, 128 and 256 tokens, SmolLM2's MATH-500 to 1,024 new tokens and the rest to 512,
    SmolLM2 asked in the chat template on 50 GSM8K problems, Gemma 3 through lm-eval's exemplars on 20; the full
    cache is swept first (the others read its record)."""
    from omegaconf import OmegaConf

    from h2o_eval.grid import preset_sweep
    from h2o_eval.names import compose, expand

    jobs = expand(preset_sweep(["+experiment=reasoning"]))
    assert len(jobs) == 2 * 2 * 8 * 3
    configs = [OmegaConf.to_container(compose(job), resolve=True) for job in jobs]
    assert configs[0]["policy"]["name"] == "full"
    prompts = {("gemma3-270m", "gsm8k"): "gsm8k_cot", ("gemma3-270m", "math500"): "minerva_math"}
    limits = {("smollm2-135m", "gsm8k"): 50}
    for config in configs:
        name, cell = config["policy"]["name"], (config["model"]["name"], config["task"]["name"])
        assert config["decoding"] == ("interval" if name in ("knorm", "expected_attention") else "evict"), name
        assert config["interval"]["target_size"] == config["budget"] and config["budget"] in (64, 128, 256)
        assert config["task"]["max_new_tokens"] == (1024 if cell == ("smollm2-135m", "math500") else 512)
        assert config["task"]["prompt"] == prompts.get(cell, "chat") and config["task"]["instruction"] is None
        assert config["protocol"] == "prefill" and config["limit"] == limits.get(cell, 10)
    dms = [c["policy"] for c in configs if c["policy"]["name"] == "dms"]
    assert dms and all(p["threshold"] == -18.0 and p["decoding"] and p["base"] == "knorm" for p in dms)


def test_a_cell_that_never_evicts_is_marked_no_eviction_in_every_table_and_figure_never_scored(data_dir, tmp_path):
    """Three GSM8K problems, the full cache and H2O at 40 tokens (every problem evicts) and at 4096 (none does):
    the board, the summary and side-by-side tables say "no eviction" for the 4096 cell and show its score nowhere;
    its figure draws no point there; the paired tests leave it out. The board's cells name the problems agreement
    was computed on."""
    from h2o_eval import plot
    from h2o_eval.reports import figures
    from h2o_eval.reports.tables import table

    common = {"model": "tiny-llama", "task": "gsm8k", "limit": 3, "task.max_new_tokens": 12, "wandb.mode": "disabled"}
    for policy, budget in (("full", 1.0), ("h2o", 40), ("h2o", 4096)):
        execute(validate(make_config(data_dir, tmp_path / "runs", policy=policy, budget=budget, **common)))
    records = [json.loads(path.read_text()) for path in sorted((tmp_path / "runs").glob("*.json"))]
    never = next(r for r in records if r["budget"] == 4096)
    assert never["metrics"]["evicted"] == 0 and next(r for r in records if r["budget"] == 40)["metrics"]["evicted"] == 1
    plot.main([str(tmp_path / "runs"), "--board", "--out", str(tmp_path / "board")])
    board = (tmp_path / "board" / "board.md").read_text()
    h2o_column = [line.split("|")[3].strip() for line in board.splitlines() if line.startswith("| 4096 ")]
    assert h2o_column and set(h2o_column) == {"no eviction"}
    assert [line for line in board.splitlines() if line.startswith("| 40 ")][0].split("|")[3].strip() != "no eviction"
    assert f"({never['metrics']['agreement_n']})" in board or "agreement" not in never["metrics"]
    plot.main([str(tmp_path / "runs"), "--metric", "same_trace", "--at", "4096", "--out", str(tmp_path / "plots")])
    summary = (tmp_path / "plots" / "summary.md").read_text()
    assert [line for line in summary.splitlines() if "4096 tokens" in line][0].count("no eviction") == 1
    assert "no eviction" in (tmp_path / "plots" / "at_4096.md").read_text()
    assert "4096" not in (tmp_path / "plots" / "paired_full.md").read_text()
    rows = [r for r in table(records, "same_trace") if r["budget"] == 4096]
    assert rows and all(r["no_eviction"] for r in rows)
    drawn = figures.figure(table(records, "same_trace"), "gsm8k")
    xs = {float(x) for ax in drawn.axes for line in ax.lines for x in line.get_xdata()}
    assert 40 in xs and 4096 not in xs
    assert "no eviction" in [text.get_text() for ax in drawn.axes for text in ax.texts]


def test_lm_evals_chain_of_thought_exemplars_make_the_prompt_as_lm_eval_lays_out_a_few_shot_prompt():
    """task.prompt=gsm8k_cot and minerva_math: lm-eval's own exemplars (gsm8k-cot.yaml's 8, minerva_math's 4), each
    question, a space and its target, joined by blank lines, then the problem; task.instruction=boxed appends "Hold
    Onto That Thought"'s request to the problem, in any prompt."""
    import yaml
    from lm_eval import __file__ as lm_eval_file

    from h2o_eval.models import smollm2_tokenizer
    from h2o_eval.runners.math_prompts import INSTRUCTIONS, ask

    tokenizer = smollm2_tokenizer()
    shots = yaml.safe_load((Path(lm_eval_file).parent / "tasks/gsm8k/gsm8k-cot.yaml").read_text())
    shots = shots["fewshot_config"]["samples"]
    asked = ask(tokenizer, {"prompt": "gsm8k_cot", "instruction": None}, "How many?")
    text = tokenizer.decode(asked.context + asked.question)
    expected = "".join(f"Q: {s['question']}\nA: {s['target']}\n\n" for s in shots) + "Q: How many?\nA:"
    assert len(shots) == 8 and text == (tokenizer.bos_token or "") + expected and asked.stops == ("Q:",)
    minerva = ask(tokenizer, {"prompt": "minerva_math", "instruction": "boxed"}, "Find x.")
    text = tokenizer.decode(minerva.context + minerva.question)
    assert text.count("Problem:\n") == 5 and text.count("Final Answer: The final answer is") == 4
    assert text.endswith("Problem:\nFind x." + INSTRUCTIONS["boxed"] + "\n\nSolution:") and minerva.stops == (
        "Problem:",
    )
    chat = ask(tokenizer, {"prompt": "chat", "instruction": "boxed"}, "Find x.")
    assert 'Find x.\nSolve the problem step by step. Wrap your final answer in "\\boxed{}".' in tokenizer.decode(
        chat.question
    )


def test_rows_end_at_their_stop_strings_as_at_an_end_of_sequence_and_leave_their_batch(monkeypatch):
    """Reference: each prompt generated alone with no stop string, its text cut at the first occurrence of the stop
    string; implementation: the batch through decode_leaving with the stop string, the rows leaving as their text
    ends in it. Each row's tokens are its own up to (and with) the stop string's tokens, and a row that never writes
    it runs to the limit."""
    from h2o_eval import load_model, make_policy
    from h2o_eval.generation import GenerationLog, make_batch, run_batch

    model, tokenizer = load_model("tiny-llama", device="cpu")
    monkeypatch.setattr(model.generation_config, "eos_token_id", None)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(5, 500, (n,), generator=generator).tolist() for n in (12, 17, 9)]
    settings = {"max_new_tokens": 16, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}

    def run(rows, **extra):
        batch = make_batch([prompts[r] for r in rows], [[] for _ in rows], tokenizer.pad_token_id, "cpu", split=False)
        return run_batch(model, make_policy("h2o", budget=20), batch, GenerationLog(16), tokenizer,
                         protocol="prefill", kernels="torch", leaving=True, **settings, **extra)  # fmt: skip

    free = [run([r])[0]["tokens"] for r in range(3)]
    stop = tokenizer.decode(free[0][5:7])  # a string row 0 writes at its 7th token
    assert stop.strip() and stop not in tokenizer.decode(free[0][:6])
    ended = run(range(3), stop_strings=[stop])
    for alone, row in zip(free, ended, strict=True):
        text = tokenizer.decode(alone)
        if stop not in text:
            assert row["tokens"] == alone
            continue
        cut = next(n for n in range(1, len(alone) + 1) if stop in tokenizer.decode(alone[:n]))
        assert row["tokens"] == alone[:cut]
    assert len(ended[0]["tokens"]) == 7
