"""Any lm-eval task by name (``task=lm_eval``), and lm-eval's own CLI with the eviction backend.

The tasks are not in ``conf/task/``: hand-written lm-eval YAMLs (one ``multiple_choice``, one ``generate_until``)
over JSONL files written here, found through ``task.include_path``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

WORDS = ("the", "river", "carried", "old", "boats", "past", "quiet", "towns", "while", "birds", "tall", "trees")
N_DOCS = 16


def _question(i: int) -> str:
    return " ".join(WORDS[(i + k) % len(WORDS)] for k in range(24 + i % 5))


def write_tasks(folder, answers: list[str]) -> None:
    """``mc_task`` (multiple choice: acc, acc_norm, brier_score) and ``gen_task`` (generate_until: exact_match
    against ``answers``) over JSONL files in ``folder``."""
    folder.mkdir(exist_ok=True)
    mc = [{"question": _question(i), "choices": ["yes", "no", "maybe"], "label": i % 3} for i in range(N_DOCS)]
    gen = [{"question": _question(i), "answer": answer} for i, answer in enumerate(answers)]
    for name, rows in (("mc", mc), ("gen", gen)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = {"dataset_path": "json", "dataset_name": None, "test_split": "test"}
    tasks = {
        "mc_task": {
            "output_type": "multiple_choice",
            "doc_to_text": "Question: {{question}}\nAnswer:",
            "doc_to_choice": "{{choices}}",
            "doc_to_target": "label",
            "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}, {"metric": "brier_score"}],
        },
        "gen_task": {
            "output_type": "generate_until",
            "doc_to_text": "Q: {{question}}\nA:",
            "doc_to_target": "{{answer}}",
            "generation_kwargs": {"until": ["\n"], "max_gen_toks": 6, "do_sample": False},
            "metric_list": [{"metric": "exact_match"}],
        },
    }
    for task, body in tasks.items():
        files = {"dataset_kwargs": {"data_files": {"test": str(folder / f"{task.split('_')[0]}.jsonl")}}}
        (folder / f"{task}.yaml").write_text(yaml.safe_dump({"task": task, **common, **files, **body}))


def reference(folder, task: str, log_samples: bool = False) -> dict:
    """lm-eval's own simple_evaluate on the unpatched model."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from h2o_eval.models import load_model

    model, tokenizer = load_model("tiny-llama", device="cpu")
    return simple_evaluate(
        model=HFLM(pretrained=model, tokenizer=tokenizer, batch_size=4),
        tasks=[task],
        task_manager=TaskManager(include_path=str(folder), include_defaults=False),
        log_samples=log_samples,
        random_seed=1234,
        numpy_random_seed=1234,
        torch_random_seed=1234,
        fewshot_random_seed=1234,
    )


def run(module: str, *args: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline"}
    done = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """The task folder, with ``gen_task``'s answers set to what the unpatched model generates: the full cache
    must then score exact_match 1.0, and eviction that changes any generation scores less."""
    folder = tmp_path_factory.mktemp("tasks")
    write_tasks(folder, ["?"] * N_DOCS)
    samples = reference(folder, "gen_task", log_samples=True)["samples"]["gen_task"]
    generated = {s["doc_id"]: s["filtered_resps"][0] for s in samples}
    write_tasks(folder, [generated[i] for i in range(N_DOCS)])
    return folder


@pytest.fixture(scope="module")
def records(tasks, tmp_path_factory):
    """Both tasks with ``full`` and ``h2o`` at budget 0.1, through ``python -m h2o_eval``: {(task, policy): record}."""
    cwd = tmp_path_factory.mktemp("cli")
    done = run(
        "h2o_eval",
        "--multirun",
        "model=tiny-llama",
        "task=lm_eval",
        "task.name=mc_task,gen_task",
        f"task.include_path={tasks}",
        "policy=full,h2o",
        "budget=0.1",
        "batch_size=4",
        "results_dir=out",
        cwd=cwd,
    )
    assert "4 ran, 0 skipped, 0 failed" in done.stdout
    found = [json.loads(path.read_text()) for path in (cwd / "out").glob("*.json")]
    return {(r["task"], r["policy"]): r for r in found}


@pytest.mark.slow
def test_a_task_outside_conf_scores_like_lm_eval_with_the_full_cache(tasks, records):
    """Reference: lm-eval's simple_evaluate on the unpatched model; implementation: the CLI with ``full``."""
    for task, metrics in (("mc_task", ("acc", "acc_norm", "brier_score")), ("gen_task", ("exact_match",))):
        expected = reference(tasks, task)["results"][task]
        record = records[(task, "full")]
        assert record["n_samples"] == N_DOCS and record["metric"] == metrics[0]
        for metric in metrics:
            assert record["metrics"][metric] == expected[f"{metric},none"], (task, metric)
    assert records[("gen_task", "full")]["metrics"]["exact_match"] == 1.0
    assert records[("gen_task", "full")]["capacity"]["kept_fraction_mean"] == 1.0
    assert records[("mc_task", "full")]["output_type"] == "multiple_choice"
    assert records[("gen_task", "full")]["protocol"] == "prefill"  # generate_until: the deployment protocol


@pytest.mark.slow
def test_h2o_at_a_small_budget_scores_differently(records):
    mc, gen = records[("mc_task", "h2o")], records[("gen_task", "h2o")]
    assert mc["metrics"]["brier_score"] != records[("mc_task", "full")]["metrics"]["brier_score"]
    assert mc["capacity"]["kept_fraction_mean"] < 0.2
    assert gen["metrics"]["exact_match"] < 1.0, "eviction to 10 % changed no generation"
    assert gen["capacity"]["sequences"] == N_DOCS and gen["capacity"]["kept_fraction_mean"] < 0.5


def test_the_record_identity_covers_the_task_files(tasks, tmp_path):
    """Editing the task's data or YAML names a new record (a run on other data never reuses old numbers); the
    folder's path itself is not identity."""
    from conftest import make_config

    from h2o_eval import results

    copy = tmp_path / "copy"
    copy.mkdir()
    for path in tasks.iterdir():
        (copy / path.name).write_text(path.read_text().replace(str(tasks), str(copy)))
    settings = {"task.name": "mc_task", "task.include_path": str(copy)}
    config = make_config(None, tmp_path, model="tiny-llama", task="lm_eval", **settings)
    named = [results.record_path(tmp_path, config)]
    (tmp_path / "link").symlink_to(copy)
    config["task"]["include_path"] = str(tmp_path / "link")
    assert results.record_path(tmp_path, config) == named[0]
    (copy / "mc.jsonl").write_text((copy / "mc.jsonl").read_text().replace("maybe", "perhaps"))
    named.append(results.record_path(tmp_path, config))
    (copy / "mc_task.yaml").write_text((copy / "mc_task.yaml").read_text().replace("Answer:", "A:"))
    named.append(results.record_path(tmp_path, config))
    assert len(set(named)) == 3 and all("__mc_task__" in path.name for path in named)


@pytest.mark.slow
def test_lm_eval_cli_gives_the_numbers_of_h2o_eval(tasks, records, tmp_path):
    """Reference: ``python -m h2o_eval`` records; implementation: ``python -m h2o_eval.lm_eval --model h2o_eval``
    with the same model, policy, budget and protocol (lm-eval's table printed, its results file read)."""
    for task, protocol in (("mc_task", "simulate"), ("gen_task", "prefill")):
        done = run(
            "h2o_eval.lm_eval",
            "--model",
            "h2o_eval",
            "--model_args",
            f"pretrained=tiny-llama,policy=h2o,budget=0.1,protocol={protocol}",
            "--tasks",
            task,
            "--include_path",
            str(tasks),
            "--batch_size",
            "4",
            "--output_path",
            str(tmp_path / task),
            cwd=tmp_path,
        )
        assert f"|{task}" in done.stdout.replace(" ", "")  # lm-eval's table
        (path,) = (tmp_path / task).rglob("results_*.json")
        got = json.loads(path.read_text())["results"][task]
        record = records[(task, "h2o")]
        assert record["protocol"] == protocol
        for metric, value in record["metrics"].items():
            assert got[f"{metric},none"] == value, (task, metric)


def test_a_group_is_refused_with_one_line_naming_the_fix(tmp_path):
    (tmp_path / "group.yaml").write_text(yaml.safe_dump({"group": "both_tasks", "task": ["mc_task", "gen_task"]}))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline"}
    args = ("model=tiny-llama", "task=lm_eval", "task.name=both_tasks", f"task.include_path={tmp_path}")
    done = subprocess.run(
        [sys.executable, "-m", "h2o_eval", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: task.name=both_tasks is an lm-eval group of several tasks: name its tasks")


GENERATION_FIELDS = {
    "max_new_tokens",
    "prompt_tokens_mean",
    "generated_tokens_mean",
    "generated_tokens_per_s",
    "kv_peak_entries",
    "kv_peak_bytes",
    "kv_full_entries",
    "kv_full_bytes",
}
CAPACITY_FIELDS = {
    "sequences",
    "length_mean",
    "capacity_mean",
    "capacity_min",
    "capacity_max",
    "kept_fraction_mean",
    "layer_capacity_mean",
    "layer_kept_fraction_mean",
    "head_spread_mean",
    "kv_bytes_mean",
}
ROW_FIELDS = {"id", "scores", "prompt_tokens", "generated_tokens", "capacity", "budget_tokens", "kv_entries"}


@pytest.mark.slow
def test_every_runner_that_generates_records_the_same_generation_and_capacity_fields(records, tmp_path, data_dir):
    """lm-eval's generate_until (through EvictionLM), summarisation and a long-context task, each with h2o on the
    tiny Llama: the record's ``generation`` and ``capacity`` hold the same keys (a runner may add its own), every
    output row the same per-row fields, and the kept share is what the budget asks of the length it applied to."""
    from conftest import make_config

    from h2o_eval.run import run as run_config

    generated = {"lm_eval": records[("gen_task", "h2o")]}
    settings = {"model": "tiny-llama", "policy": "h2o", "budget": 0.1, "limit": 2, "batch_size": 2}
    generated["summarisation"] = run_config(
        make_config(data_dir, tmp_path / "xsum", task="xsum", num_fewshot=0, **settings,
                    **{"generation.max_new_tokens": 4, "generation.max_words": 60}),
        tmp_path / "work",
    )  # fmt: skip
    generated["long_context"] = run_config(
        make_config(data_dir, tmp_path / "niah", task="niah_single_1", **settings,
                    **{"task.length": 600, "task.max_new_tokens": 4}),
        tmp_path / "work",
    )  # fmt: skip
    folders = {"lm_eval": None, "summarisation": tmp_path / "xsum", "long_context": tmp_path / "niah"}
    for runner, record in generated.items():
        assert set(record["generation"]) >= GENERATION_FIELDS, runner
        assert set(record["capacity"]) == CAPACITY_FIELDS, runner
        assert len(record["capacity"]["layer_capacity_mean"]) == 2, runner  # tiny-llama: one mean C per layer
        assert 0.05 < record["capacity"]["kept_fraction_mean"] < 0.2, runner
        if folders[runner] is not None:
            rows = [json.loads(line) for line in (folders[runner] / record["outputs"]).read_text().splitlines()]
            assert all(set(row) >= ROW_FIELDS for row in rows), runner
            assert record["capacity"]["length_mean"] == sum(r["budget_tokens"] for r in rows) / len(rows)


@pytest.mark.slow
def test_lm_eval_cli_reads_local_data_as_h2o_eval_does(tmp_path, data_dir):
    """``python -m h2o_eval.lm_eval ... --data_dir DIR`` gives the numbers of ``python -m h2o_eval task=copa
    data_dir=DIR`` (the same one-task YAML over the local file); without ``--data_dir``, offline, the task is refused
    in one line naming it, before any model loads."""
    from conftest import make_config

    from h2o_eval.run import run as run_config

    args = ["--model", "h2o_eval", "--model_args", "pretrained=tiny-llama,policy=h2o,budget=0.2", "--tasks", "copa"]
    args += ["--limit", "10", "--batch_size", "4"]
    done = run("h2o_eval.lm_eval", *args, "--data_dir", str(data_dir), "--output_path", str(tmp_path / "out"),
               cwd=tmp_path)  # fmt: skip
    (path,) = (tmp_path / "out").rglob("results_*.json")
    got = json.loads(path.read_text())["results"]["copa"]
    record = run_config(make_config(data_dir, tmp_path / "runs", model="tiny-llama", task="copa", limit=10,
                                    batch_size=4), tmp_path / "work")  # fmt: skip
    assert got["acc,none"] == record["metrics"]["acc"] and "|copa" in done.stdout.replace(" ", "")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    refused = subprocess.run([sys.executable, "-m", "h2o_eval.lm_eval", *args], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert refused.returncode == 2 and "Loading weights" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1].startswith("error: task=copa reads ")
    assert "set --data_dir to a folder holding copa/<split>.jsonl" in refused.stderr


@pytest.mark.parametrize(
    ("model_args", "extra", "message"),
    [
        (
            "pretrained=tiny-llama,policy=h2oo",
            [],
            "policy=h2oo: no policy of that name: use one of adakv, block, chunk,",
        ),
        ("pretrained=tiny-llama,budget=1.5", [], "budget=1.5: use a fraction in (0, 1]"),
        ("pretrained=tiny-llama,heavy_ratioo=0.3", [], "policy 'h2o' takes no heavy_ratioo: its parameters are"),
        ("pretrained=tiny-llama,protocol=strem", [], "protocol='strem': use one of simulate, prefill"),
        ("pretrained=tiny-llama,kernels=fast", [], "kernels='fast': use one of auto, torch, triton"),
        ("pretrained=tiny-llama,dtype=float99", [], "unknown dtype 'float99'"),
        ("pretrained=tiny-llama", ["--batch_size", "auto"], "--batch_size auto: use a number >= 1"),
        ("pretrained=tiny-llama", ["--device", "gpu"], "device='gpu' is not a device"),
        ("policy=h2o", [], "--model_args names no model: add pretrained=NAME"),
        ("pretrained=nobody/no-model", [], "nobody/no-model is not in the Hugging Face cache"),
        ("pretrained=tiny-llama,policy=kvzip,protocol=prefill", [], "policy=kvzip scores its prompt by extra passes"),
    ],
    ids=[
        "policy",
        "budget",
        "policy-parameter",
        "protocol",
        "kernels",
        "dtype",
        "batch-size",
        "device",
        "no-model",
        "model-offline",
        "policy-for-task",
    ],
)
def test_lm_eval_cli_refuses_bad_model_args_in_one_line_before_any_model_loads(
    model_args, extra, message, data_dir, monkeypatch, capsys
):
    """In-process, with ``load_model`` replaced by one that records its calls: each bad setting stops the CLI with
    one line and exit status 2, and no model was ever asked for."""
    from h2o_eval import lm_eval, models

    loads = []
    monkeypatch.setattr(models, "load_model", lambda *args, **kwargs: loads.append(args))
    argv = ["--model", "h2o_eval", "--model_args", model_args, "--tasks", "copa", "--data_dir", str(data_dir), *extra]
    monkeypatch.setattr(sys, "argv", ["h2o_eval.lm_eval", *argv, "--limit", "2"])
    with pytest.raises(SystemExit) as stopped:
        lm_eval.main()
    assert stopped.value.code == 2 and not loads
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and error.startswith("error: ") and message in error, error
