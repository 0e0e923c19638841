"""One prompt pass for many policies: a :class:`SharedPrompt` leaves every cache as feeding it alone would, shared
cells answer as separate runs, and ``python -m h2o_eval.grid`` writes the records ``python -m h2o_eval`` would."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
import weakref

import pytest
from conftest import make_config

from h2o_eval import generation, grid
from h2o_eval.cache import EvictionCache
from h2o_eval.errors import ConfigError
from h2o_eval.groups import SharedPrompt
from h2o_eval.models import load_model
from h2o_eval.policies import configured_policy, make_policy
from h2o_eval.run import execute, validate
from h2o_eval.runners.long_context import RUNNER

# A fixed set of cells for the grid's own mechanics (configs need each policy's conf/policy YAML).
POLICIES = [("full", 1.0), ("h2o", 0.3), ("tova", 0.3), ("snapkv", 0.3), ("adakv", 0.4), ("knorm", 0.3)]
POLICIES += [("streaming", 0.3), ("local", 0.25)]


@pytest.mark.slow
def test_shared_cells_answer_as_separate_runs(data_dir, tmp_path):
    """Reference: the long-context runner's evaluate, one cell at a time; implementation: evaluate_shared over all
    the cells, in both protocols, batches of 3 documents of 2 questions (whose lengths differ, so the context protocol
    answers them in groups of one length from copies of the compressed cache). Under context, policies that score by
    extra passes (KVzip's repeat, the oracle's answer) follow cells that answered in groups."""
    settings = {"model": "tiny-llama", "task": "niah_single_1", "limit": 6, "batch_size": 3}
    settings |= {"task.length": 700, "task.max_new_tokens": 8, "task.questions": 2}
    passes = [("kvzip", 0.3), ("expected_attention", 0.3), ("oracle", 0.3)]
    cells = [(p, "prefill", b) for p, b in POLICIES[:4]] + [(p, "context", b) for p, b in POLICIES[3:] + passes]
    configs = [
        validate(make_config(data_dir, tmp_path, **settings, policy=p, protocol=protocol, budget=b)).config
        for p, protocol, b in cells
    ]
    model, tokenizer = load_model("tiny-llama", device="cpu")
    separate = [RUNNER.evaluate(model, tokenizer, configured_policy(c), c) for c in configs]
    shared = RUNNER.evaluate_shared(model, tokenizer, [(configured_policy(c), c) for c in configs])
    answers = set()
    for one, together in zip(separate, shared, strict=True):
        fields, outputs, shared_fields, shared_outputs = one.fields, one.outputs, together.fields, together.outputs
        keys = ("id", "prediction", "capacity", "generated_tokens", "scores")
        assert [[o[k] for k in keys] for o in shared_outputs] == [[o[k] for k in keys] for o in outputs]
        assert shared_fields["capacity"] == fields["capacity"] and shared_fields["metrics"] == fields["metrics"]
        assert shared_fields["generation"]["kv_peak_entries"] == fields["generation"]["kv_peak_entries"]
        answers.add(tuple(o["prediction"] for o in outputs))
    assert len(answers) > 2, "the policies should answer differently here, or the test proves little"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
def test_stacked_cells_answer_as_separate_runs(data_dir, tmp_path, monkeypatch, name):
    """Reference: each cell evaluated alone; implementation: evaluate_shared with ``stack_cells``, where every cell
    but the oracle's answers each group of questions in one batch from its own stacked compressed cache, with a
    full copy of the context whose answer the oracle's two cells then compress for, answering in a second batch
    (protocol=context, decoding=grow; one document's two questions, each answered from stacked copies).
    Answers, capacities, kept entries, generated tokens, the KV peak and the full cache's entries (each cell's
    generation as long as it would have run alone, though the batch runs on for other cells' rows) are the
    separate runs'; the generations really ran stacked, two per question and no other, and the caches each stack
    was made of were freed before it decoded (its views hold what they held). tiny-gemma3 has sliding layers,
    stacked as they are."""
    settings = {"model": name, "task": "niah_single_1", "limit": 1, "batch_size": 1, "decoding": "grow"}
    settings |= {"task.length": 600, "task.max_new_tokens": 8, "task.questions": 2, "protocol": "context"}
    cells = POLICIES[1:] + [("full", 1.0), ("kvzip", 0.3), ("expected_attention", 0.2), ("oracle", 0.3)]
    cells += [("oracle", 0.6)]
    configs = [
        validate(make_config(data_dir, tmp_path, **settings, policy=p, budget=b, stack_cells=True)).config
        for p, b in cells
    ]
    model, tokenizer = load_model(name, device="cpu")
    # An end of sequence these random models generate in some answers only, so rows of one batch stop apart.
    model.generation_config.eos_token_id = {"tiny-llama": 11746, "tiny-gemma3": 13437}[name]
    separate = [RUNNER.evaluate(model, tokenizer, configured_policy(c), c) for c in configs]
    lengths = {o["generated_tokens"] for one in separate for o in one.outputs}
    assert len(lengths) > 1 and max(lengths) == 8, "answers should stop at different steps, or this proves little"
    batches, calls, made, freed = [], [], [], []
    leaving, decode, stack = generation.passes.decode_leaving, generation.passes.decode, EvictionCache.stack.__func__

    def stacked(model, cache, ids, *args, **kwargs):
        batches.append(len(ids))
        gc.collect()
        freed.append(all(ref() is None for ref in made[-1]))
        return leaving(model, cache, ids, *args, **kwargs)

    def remembered(cls, caches):
        made.append([weakref.ref(cache) for cache in caches])
        return stack(cls, caches)

    monkeypatch.setattr(EvictionCache, "stack", classmethod(remembered))
    monkeypatch.setattr("h2o_eval.generation.answering.decode_leaving", stacked)
    monkeypatch.setattr(
        "h2o_eval.generation.passes.decode", lambda m, c, i, *a, **k: calls.append(len(i)) or decode(m, c, i, *a, **k)
    )
    shared = RUNNER.evaluate_shared(model, tokenizer, [(configured_policy(c), c) for c in configs])
    assert batches == [len(cells) - 1, 2] * 2, "per question, the others and a full copy, then the oracle's cells"
    assert freed == [True] * 4, "the caches a stack is made of should be freed while it decodes (its views hold them)"
    assert len(calls) > len(batches) and calls[1] < calls[0], "rows should have left the batch as their answers ended"
    answers = set()
    keys = ("id", "prediction", "capacity", "generated_tokens", "scores", "kv_entries", "prompt_tokens")
    for one, together in zip(separate, shared, strict=True):
        assert [[o[k] for k in keys] for o in together.outputs] == [[o[k] for k in keys] for o in one.outputs]
        assert together.fields["capacity"] == one.fields["capacity"]
        for field in ("kv_peak_entries", "kv_full_entries", "generated_tokens_mean"):
            assert together.fields["generation"][field] == one.fields["generation"][field], field
        answers.add(tuple(o["prediction"] for o in one.outputs))
    assert len(answers) > 2, "the policies should answer differently here, or the test proves little"


@pytest.mark.parametrize("stack", [False, True])
def test_cells_that_differ_in_threshold_share_the_prompt_and_answer_as_separate_runs(data_dir, tmp_path, stack):
    """A sweep of thresholds (the ``dms`` of one base, kvpress's DMSPress) beside the base at a budget is one group
    of the grid; reference: each cell evaluated alone; implementation: the group's shared evaluation, its copies
    decoded one by one or stacked. Answers, capacities, kept entries and the KV peak are the separate runs', and
    the thresholds keep different shares of the context."""
    settings = {"model": "tiny-llama", "task": "niah_single_1", "limit": 2, "batch_size": 2, "decoding": "grow"}
    settings |= {"task.length": 600, "task.max_new_tokens": 6, "protocol": "context", "stack_cells": stack}
    cells = [{"threshold": t} for t in (-0.7, -0.6, -0.5)] + [{"budget": 0.3}]
    specs = [validate(make_config(data_dir, tmp_path, **settings, policy="knorm", **cell)) for cell in cells]
    assert [len(group) for group in grid.groups(specs)] == [len(cells)]
    configs = [spec.config for spec in specs]
    model, tokenizer = load_model("tiny-llama", device="cpu")
    separate = [RUNNER.evaluate(model, tokenizer, configured_policy(c), c) for c in configs]
    shared = RUNNER.evaluate_shared(model, tokenizer, [(configured_policy(c), c) for c in configs])
    keys = ("id", "prediction", "capacity", "generated_tokens", "kv_entries", "prompt_tokens")
    for one, together in zip(separate, shared, strict=True):
        assert [[o[k] for k in keys] for o in together.outputs] == [[o[k] for k in keys] for o in one.outputs]
        assert together.fields["capacity"] == one.fields["capacity"]
        assert together.fields["generation"]["kv_peak_entries"] == one.fields["generation"]["kv_peak_entries"]
    kept = [one.fields["capacity"]["kept_fraction_mean"] for one in separate[:3]]
    assert 1 > kept[0] > kept[1] > kept[2], f"the rising thresholds should keep falling shares here: {kept}"


def test_a_refused_cell_names_what_sets_it_apart_once():
    """The swept overrides of a refused cell lead its line, unless the error begins with one, or with its value (a
    policy's errors begin with its name)."""
    cells = [["policy=streaming", "budget=2"], ["policy=h2o", "budget=2"]]
    said = "streaming: sinks=4 leaves no slot for recent tokens in a budget of 2 tokens"
    assert grid.refusal(cells[0], cells, said) == said
    assert grid.refusal(cells[0], cells, f"policy=streaming: {said}") == f"policy=streaming: {said}"
    assert grid.refusal(cells[1], cells, "budget too small") == "policy=h2o: budget too small"


@pytest.mark.slow
def test_the_grid_writes_the_records_a_run_would(data_dir, tmp_path, monkeypatch, capsys):
    """A sweep through the grid: shareable cells run together, a simulate cell alone, SnapKV's simulate cell is
    refused in one line (``on_error=skip``); each record sits where ``python -m h2o_eval`` looks for it (a run of
    the same cell skips), and answers as a separate run does."""
    monkeypatch.chdir(tmp_path)
    args = ["model=tiny-llama", "task=niah_single_1", "task.length=700", "++task.max_new_tokens=6", "limit=4"]
    args += ["batch_size=2", f"data_dir={data_dir}", "results_dir=grid", "wandb.mode=disabled"]
    sweep = [*args, "policy=h2o,snapkv,full", "budget=0.3,0.5", "protocol=prefill,context,simulate", "on_error=skip"]
    with pytest.raises(SystemExit) as stopped:
        grid.main(sweep)
    out = capsys.readouterr().out
    refusals = [line for line in out.splitlines() if line.startswith("refused: ")]
    assert stopped.value.code == 1 and len(refusals) == 2 and all("policy=snapkv" in line for line in refusals)
    # full is one setting at every budget: 2 x h2o, 2 x snapkv, 1 x full per protocol, one h2o and full simulate
    assert "13 cells, 0 with records, 13 to compute, 2 refused" in out
    assert "10 cells of niah_single_1 share their prompts" in out
    assert out.count("tiny-llama | niah_single_1") == 26  # each record's line, then the summary table
    records = sorted((tmp_path / "grid").glob("*.json"))
    assert len(records) == 13
    shared = [json.loads(p.read_text()) for p in records if "prefill" in p.name or "context" in p.name]
    assert [r["generation"]["shared_prompt_cells"] for r in shared] == [10] * 10
    assert len({json.dumps(r["peak_memory"]) for r in shared}) == 1  # one peak for the cells evaluated together
    cell = {"model": "tiny-llama", "task": "niah_single_1", "task.length": 700, "++task.max_new_tokens": 6}
    cell |= {"limit": 4, "batch_size": 2, "policy": "h2o", "budget": 0.5, "protocol": "context"}
    assert execute(validate(make_config(data_dir, tmp_path / "grid", **cell)))[0] == "skipped"
    status, alone = execute(validate(make_config(data_dir, tmp_path / "alone", **cell)))
    [together] = [r for r in shared if r["policy"] == "h2o" and r["protocol"] == "context" and r["budget"] == 0.5]
    assert status == "ran" and together["metrics"] == alone["metrics"]

    def predictions(folder, record):
        lines = (folder / record["outputs"]).read_text().splitlines()
        return [json.loads(line)["prediction"] for line in lines]

    assert predictions(tmp_path / "grid", together) == predictions(tmp_path / "alone", alone)
    with pytest.raises(SystemExit):
        grid.main(sweep)
    assert "13 cells, 13 with records, 0 to compute, 2 refused" in capsys.readouterr().out


def test_a_second_grid_over_cells_in_progress_waits_and_takes_their_records(data_dir, tmp_path, monkeypatch, capsys):
    """Two grids over the same cells (two lanes, or two nodes sharing a folder): the second, started while the first
    computes them, waits for the group's lock, then takes the records the first wrote; the cells are computed once."""
    import threading

    from h2o_eval import run

    monkeypatch.chdir(tmp_path)
    sweep = ["model=tiny-llama", "task=niah_single_1", "task.length=600", "++task.max_new_tokens=4", "limit=2"]
    sweep += ["batch_size=2", f"data_dir={data_dir}", "results_dir=shared", "wandb.mode=disabled"]
    sweep += ["policy=h2o,knorm", "budget=0.5", "protocol=context"]
    computed, inside, scanned, compute, groups = [], threading.Event(), threading.Event(), run.compute, grid.groups

    def computing(specs, *args):
        computed.append(len(specs))
        inside.set()
        assert scanned.wait(60), "the second grid never looked at the records"
        time.sleep(0.5)  # the second grid reaches the lock while this one holds it
        return compute(specs, *args)

    def grouping(todo):
        if inside.is_set():
            scanned.set()  # the second grid found no records: it will compute them, or wait for them
        return groups(todo)

    monkeypatch.setattr(run, "compute", computing)
    monkeypatch.setattr(grid, "groups", grouping)
    lanes = [threading.Thread(target=grid.main, args=(sweep,)) for _ in range(2)]
    lanes[0].start()
    assert inside.wait(60)
    lanes[1].start()
    for lane in lanes:
        lane.join(120)
    out = capsys.readouterr().out
    assert computed == [2], computed
    assert out.count("2 cells, 0 with records, 2 to compute") == 2
    assert out.count("was written meanwhile") == 2 and out.count("waiting: another process") >= 1
    assert len(list((tmp_path / "shared").glob("*.json"))) == 2


def test_the_grid_refuses_bad_names_in_one_line(data_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        grid.main(["model=tiny-llama", "task=niah_single_1", "policy=h2o,nope", f"results_dir={tmp_path / 'r'}"])
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and error.startswith("error: policy=nope: no policy of that name: use one of adakv")
    assert not (tmp_path / "r").exists()
    with pytest.raises(ConfigError, match="cannot be shared"):
        SharedPrompt([EvictionCache(load_model("tiny-llama")[0], make_policy("h2o", budget=0.5))])


def test_an_invalid_cell_stops_the_grid_before_anything_runs(data_dir, tmp_path, capsys):
    """SnapKV cannot simulate: its two simulate cells are one line each, and the valid cells do not run."""
    args = ["model=tiny-llama", "task=niah_single_1", "task.length=700", "limit=2", f"data_dir={data_dir}"]
    args += ["policy=h2o,snapkv", "budget=0.3,0.5", "protocol=prefill,simulate", f"results_dir={tmp_path / 'r'}"]
    with pytest.raises(SystemExit) as stopped:
        grid.main(args)
    assert stopped.value.code == 2
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        f"error: policy=snapkv budget={budget} protocol=simulate: policy 'snapkv' exists only in the prefill and "
        "context protocols: use protocol=prefill"
        for budget in (0.3, 0.5)
    ]
    assert out == "" and not (tmp_path / "r").exists()


def test_the_grid_refuses_a_task_setting_its_task_does_not_take_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        grid.main(["model=tiny-llama", "task=niah_single_1,vt", "+task.num_hops=2", f"results_dir={tmp_path / 'r'}"])
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and error.startswith("error: task niah_single_1 takes no num_hops: its settings are ")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("typo", ["budjet=0.5", "+budjet=0.5"])
def test_the_grid_refuses_a_key_the_config_does_not_define_in_one_line(tmp_path, capsys, typo):
    with pytest.raises(SystemExit) as stopped:
        grid.main(["+experiment=kv_leaderboard_quick", "model=tiny-llama", typo, f"results_dir={tmp_path / 'r'}"])
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error == f"error: {typo}: the config has no setting 'budjet': did you mean budget?"
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_the_grids_wandb_runs_go_under_results_dir_and_nothing_into_the_temporary_folder(data_dir, tmp_path):
    """The grid's W&B offline runs land in ``<results_dir>/wandb/``; the system's temporary folder (``TMPDIR``) is
    left as it was. torch's own compile cache is pointed elsewhere: it is torch's, made on import."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    env = {**os.environ, "TMPDIR": str(temporary), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    args = ["model=tiny-llama", "task=niah_single_1", "task.length=600", "++task.max_new_tokens=2", "limit=2"]
    args += ["policy=h2o,local", "budget=0.5", "protocol=prefill", f"data_dir={data_dir}", "results_dir=out"]
    args += ["wandb.mode=offline"]
    done = subprocess.run([sys.executable, "-m", "h2o_eval.grid", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(list((tmp_path / "out" / "wandb").glob("offline-run-*/run-*.wandb"))) == 2
    assert not list(temporary.iterdir())
    assert "wandb:" not in done.stdout + done.stderr


def test_grid_records_name_the_commit_their_cells_started_from(data_dir, tmp_path, commit_lands_during_the_run):
    args = ["model=tiny-llama", "task=niah_single_1", "task.length=600", "++task.max_new_tokens=2", "limit=2"]
    grid.main(
        [*args, "policy=h2o,local", "budget=0.5", "protocol=prefill", f"data_dir={data_dir}"]
        + [f"results_dir={tmp_path / 'grid'}", "wandb.mode=disabled"]
    )
    records = [json.loads(path.read_text()) for path in (tmp_path / "grid").glob("*.json")]
    assert len(records) == 2 and all(r["git"] == {"commit": "started", "dirty": False} for r in records)


def test_the_leaderboard_preset_sweeps_rulers_tasks_in_kvpress_protocol(data_dir, tmp_path, capsys):
    """``+experiment=kv_leaderboard`` through the grid: its own sweep (13 tasks, every deployable policy, the full
    cache and the oracle, kvpress's four ratios) where the command line narrows nothing, kvpress's protocol (the
    context compressed without the question, kept int(L * (1 - ratio)), nothing evicted afterwards) in every
    record."""
    from h2o_eval.grid import preset_sweep
    from h2o_eval.names import expand

    plain = ["model=tiny-llama", "policy=h2o,local"]
    assert preset_sweep(plain) == plain  # no preset, no sweep of its own
    swept = expand(preset_sweep(["+experiment=kv_leaderboard", "model=tiny-llama"]))
    tasks = {cell[-3].split("=")[1] for cell in swept}
    assert len(swept) == 13 * 16 * 4 and len(tasks) == 13 and "qa_2" in tasks
    args = ["+experiment=kv_leaderboard", "model=tiny-llama", "task=niah_single_1", "task.length=700", "limit=2"]
    args += ["policy=full,snapkv", "budget=0.75,0.25", "++task.max_new_tokens=4", f"data_dir={data_dir}"]
    grid.main([*args, f"results_dir={tmp_path}", "wandb.mode=disabled"])
    assert "3 cells, 0 with records, 3 to compute, 0 refused" in capsys.readouterr().out
    records = [json.loads(path.read_text()) for path in tmp_path.glob("*.json")]
    assert {(r["protocol"], r["config"]["decoding"], r["config"]["rounding"]) for r in records} == {
        ("context", "grow", "down")
    }
    snapkv = {r["budget"]: r["capacity"]["capacity_mean"] for r in records if r["policy"] == "snapkv"}
    context = records[0]["capacity"]["length_mean"]
    assert snapkv[0.25] == pytest.approx(int(0.25 * context), abs=1) and snapkv[0.75] > snapkv[0.25]


@pytest.mark.parametrize(("preset", "questions"), [("kv_leaderboard", 1), ("kv_leaderboard_shared", 4)])
def test_the_leaderboard_presets_name_their_questions_per_context_and_take_16_and_32_to_1(data_dir, preset, questions):
    """kvpress's protocol asks one question per context; the shared-context one four. Both take the ratios 0.9375 and
    0.96875 (budgets 0.0625 and 0.03125), where methods that look alike at 0.875 part, and stack their cells."""
    from h2o_eval.grid import compose

    for budget in (0.0625, 0.03125):
        config = validate(compose([f"+experiment={preset}", "model=smollm2-135m", "task=niah_single_2",
                                   "policy=snapkv", f"budget={budget}", f"data_dir={data_dir}"])).config  # fmt: skip
        assert (config["task"]["questions"], config["budget"], config["protocol"]) == (questions, budget, "context")
        assert (config["decoding"], config["rounding"], config["stack_cells"]) == ("grow", "down", True)


def test_the_grid_takes_as_many_documents_a_batch_as_its_cells_full_caches_fit_in_half_the_memory(
    data_dir, tmp_path, monkeypatch, capsys
):
    """Three cells' full caches of a 600-token document: with memory for 2.5 documents' worth, batches of 1 (half of
    it fits one), said in one line; with plenty, the asked batch_size. The answers are the same either way."""
    from h2o_eval import generation
    from h2o_eval.attention import kv_bytes_per_token

    settings = {"model": "tiny-llama", "task": "niah_single_1", "limit": 3, "batch_size": 3, "protocol": "context"}
    settings |= {"task.length": 600, "task.max_new_tokens": 4, "decoding": "grow", "budget": 0.5}
    configs = [validate(make_config(data_dir, tmp_path, **settings, policy=p)).config for p in ("full", "h2o", "knorm")]
    model, tokenizer = load_model("tiny-llama", device="cpu")
    per_document = kv_bytes_per_token(model) * 604 * 3
    batches, answer = [], generation.answer
    monkeypatch.setattr(generation, "answer", lambda *a, **k: batches.append(a[4].batch_size) or answer(*a, **k))
    cells = [(configured_policy(c), c) for c in configs]
    monkeypatch.setattr(generation, "available_memory", lambda device: 10**12)
    roomy = RUNNER.evaluate_shared(model, tokenizer, cells)
    monkeypatch.setattr(generation, "available_memory", lambda device: int(2.5 * per_document))
    tight = RUNNER.evaluate_shared(model, tokenizer, cells)
    assert batches == [3, 1]
    assert "batch_size=3 -> 1 documents a batch: 3 cells' full caches take up to" in capsys.readouterr().out
    for one, other in zip(roomy, tight, strict=True):
        assert [o["prediction"] for o in one.outputs] == [o["prediction"] for o in other.outputs]


@pytest.mark.parametrize("stack", [False, True])
def test_a_cells_cpu_time_splits_into_its_prompt_pass_scoring_question_pass_and_decoding(data_dir, tmp_path, stack):
    """Cells sharing a context's pass: each takes a third of it (equal ``prompt`` shares); KVzip's repeat passes are
    its ``scoring``, which costs more than the others' none; every cell feeds its question (``question``) and then
    decodes a token a forward (``decoding``). Under ``prefill`` nothing is a question's pass of its own."""
    settings = {"model": "tiny-llama", "task": "niah_single_1", "limit": 2, "batch_size": 2, "protocol": "context"}
    settings |= {"task.length": 600, "task.max_new_tokens": 6, "decoding": "grow", "budget": 0.5}
    settings |= {"stack_cells": stack}
    policies = ("full", "kvzip", "knorm")
    configs = [validate(make_config(data_dir, tmp_path, **settings, policy=p)).config for p in policies]
    model, tokenizer = load_model("tiny-llama", device="cpu")
    cells = [(configured_policy(c), c) for c in configs]
    parts = {
        p: e.fields["generation"]["cpu_seconds"]
        for p, e in zip(policies, RUNNER.evaluate_shared(model, tokenizer, cells), strict=True)
    }
    assert len({p["prompt"] for p in parts.values()}) == 1 and parts["full"]["prompt"] > 0
    assert parts["kvzip"]["scoring"] > 10 * max(parts["full"]["scoring"], parts["knorm"]["scoring"])
    assert all(p["question"] > 0 and p["decoding"] > 0 for p in parts.values())
    settings |= {"protocol": "prefill", "stack_cells": False}
    config = validate(make_config(data_dir, tmp_path, **settings, policy="knorm")).config
    alone = RUNNER.evaluate(model, tokenizer, configured_policy(config), config)
    found = alone.fields["generation"]["cpu_seconds"]
    assert found["question"] == 0 and found["prompt"] > 0 and found["decoding"] > 0


def test_a_config_groups_files_are_read_once_and_each_caller_gets_its_own_copy(monkeypatch):
    """A grid checks every cell's names against the config groups: the YAML files are parsed at the first call
    only, and a caller that changes what it got changes nothing the next caller gets."""
    import yaml

    import h2o_eval.conf as conf

    conf._read.cache_clear()
    parsed = []
    monkeypatch.setattr(yaml, "safe_load", lambda text, load=yaml.safe_load: parsed.append(1) or load(text))
    first = conf.options("policy")
    count = len(parsed)
    first["h2o"]["budget"] = "changed"
    again = conf.options("policy")
    assert count > 1 and len(parsed) == count
    assert again["h2o"] != first["h2o"] and again == conf._read("policy")
