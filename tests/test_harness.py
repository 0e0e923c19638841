"""lm-eval integration: the runner scores exactly what lm-eval scores, from local data, with its prompts."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import make_config

from h2o_eval.eviction_lm import question_start
from h2o_eval.models import load_model
from h2o_eval.run import run
from h2o_eval.runners import lmeval

TASKS = ("copa", "mathqa", "openbookqa", "piqa", "rte", "winogrande")


class _IgnoreTagsLoader(yaml.SafeLoader):
    """Reads lm-eval YAMLs for their plain keys, leaving ``!function`` tags unresolved (None)."""


_IgnoreTagsLoader.add_multi_constructor("!", lambda loader, suffix, node: None)


@pytest.mark.parametrize("model_name", ["tiny-llama", pytest.param("gemma3-270m", marks=pytest.mark.slow)])
def test_run_acc_equals_lm_eval_simple_evaluate(tmp_path, data_dir, model_name):
    """Reference: lm-eval's simple_evaluate on a hand-written local-data COPA YAML, unpatched model; implementation:
    run() with the full cache (the default policy, h2o at 0.2, matched it on the random tiny model only by chance)."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    config = make_config(
        data_dir, tmp_path / "results", model=model_name, task="copa", policy="full", limit=24, batch_size=4
    )
    record = run(config, tmp_path / "work")

    task_dir = tmp_path / "reference_tasks"
    task_dir.mkdir()
    reference_yaml = {
        "task": "copa_reference",
        "include": str(lmeval.lm_eval_tasks_dir() / "super_glue/copa/default.yaml"),
        "dataset_path": "json",
        "dataset_name": None,
        "dataset_kwargs": {"data_files": {"validation": str(data_dir / "copa" / "validation.jsonl")}},
        "training_split": None,
    }
    (task_dir / "copa_reference.yaml").write_text(yaml.safe_dump(reference_yaml))
    model, tokenizer = load_model(model_name)
    reference = simple_evaluate(
        model=HFLM(pretrained=model, tokenizer=tokenizer, batch_size=4),
        tasks=["copa_reference"],
        num_fewshot=0,
        limit=24,
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        log_samples=False,
    )
    assert record["n_samples"] == 24
    assert record["metrics"]["acc"] == reference["results"]["copa_reference"]["acc,none"]
    assert record["metrics"]["acc_stderr"] == reference["results"]["copa_reference"]["acc_stderr,none"]


@pytest.mark.parametrize("name", TASKS)
def test_every_task_loads_all_local_documents_with_lm_eval_prompts(tmp_path, data_dir, name):
    """Every document of the local file is evaluated, and the prompt fields are lm-eval's own."""
    task = make_config(data_dir, tmp_path, task=name)["task"]
    path = lmeval.local_data_file(task, data_dir)
    loaded = _load_local_task(tmp_path, data_dir, name)
    original = yaml.load(lmeval.source_yaml(task).read_text(), Loader=_IgnoreTagsLoader)

    docs = list(loaded.eval_docs)
    assert len(docs) == sum(1 for _ in path.open())
    assert docs[0] == json.loads(path.open().readline())
    for field in ("doc_to_text", "doc_to_target", "doc_to_choice"):
        if isinstance(original[field], str | list):
            assert getattr(loaded.config, field) == original[field]
    assert loaded.doc_to_choice(docs[0])
    assert {m["metric"] for m in loaded.config.metric_list} == {m["metric"] for m in original["metric_list"]}


@pytest.mark.parametrize("name", ["copa", "piqa"])
def test_few_shot_examples_never_include_the_scored_document(tmp_path, data_dir, name):
    """Locally the few-shot pool is the evaluated split itself; no context may show the scored document."""
    task = _load_local_task(tmp_path, data_dir, name)
    task.set_fewshot_seed(1234)
    for doc in list(task.eval_docs)[:60]:
        question = task.doc_to_text(doc)
        target = task.doc_to_target(doc)
        answer = task.doc_to_choice(doc)[target] if isinstance(target, int) else target
        answered = question + task.config.target_delimiter + answer
        context = task.fewshot_context(doc, num_fewshot=5)
        assert context.endswith(question)
        assert context.count(task.config.fewshot_delimiter) == 5
        assert answered not in context


def _load_local_task(tmp_path, data_dir, name):
    from lm_eval.tasks import TaskManager

    task = make_config(data_dir, tmp_path, task=name)["task"]
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(lmeval.task_yaml(task, data_dir)))
    return TaskManager(include_path=str(tmp_path), include_defaults=False).load([name])["tasks"][name]


@pytest.mark.parametrize("protocol", ["simulate", "prefill"])
def test_padded_lm_eval_batches_score_like_each_request_alone(protocol):
    """Reference: each request scored alone (no padding) with the context length set by hand; implementation:
    lm-eval's HFLM batching through EvictionLM, which must recover every row's length and context length."""
    import torch

    from h2o_eval import make_policy, patch
    from h2o_eval.eviction_lm import EvictionLM

    model, tokenizer = load_model("tiny-llama", device="cpu")
    texts = [
        ("The cat sat on the mat because", " it was warm."),
        ("Tea", " is hot and sweet today"),
        ("A much longer context about the history of caches and their eviction", " policies."),
        ("Short", " one"),
    ]
    requests = [((c, x), tokenizer(c).input_ids, tokenizer(x).input_ids) for c, x in texts]
    policy = make_policy("h2o", budget=0.3)
    with patch(model, policy, protocol=protocol) as session:
        lm = EvictionLM(pretrained=model, tokenizer=tokenizer, batch_size=4, session=session)
        batched = [ll for ll, _ in lm._loglikelihood_tokens(requests, disable_tqdm=True)]
        for (_, context, continuation), got in zip(requests, batched, strict=True):
            ids = torch.tensor([context + continuation[:-1]])
            session.context_lengths = [len(context)]
            with torch.no_grad():
                logprobs = torch.log_softmax(model(ids).logits[0, len(context) - 1 :], dim=-1)
            alone = logprobs.gather(-1, torch.tensor(continuation).unsqueeze(-1)).sum().item()
            assert got == pytest.approx(alone, abs=1e-4)
    lengths = set(session.capacity.lengths)
    assert len(lengths) > 1, "requests of one length prove nothing about padding"


@pytest.mark.parametrize(("name", "inputs"), [("piqa", 1), ("copa", 1), ("winogrande", 2)])
def test_context_protocol_finds_where_the_demonstrations_end(tmp_path, data_dir, name, inputs):
    """Independent path: lm-eval's own few-shot prompts, whose 3 demonstrations each end with the task's
    fewshot delimiter; the question (or, for Winogrande, each input) starts right after the third."""
    task = _load_local_task(tmp_path, data_dir, name)
    task.set_fewshot_seed(1234)
    delimiter = task.config.fewshot_delimiter
    for doc in list(task.eval_docs)[:20]:
        prompts = task.fewshot_context(doc, num_fewshot=3)
        prompts = prompts if isinstance(prompts, list) else [prompts]
        assert len(prompts) == inputs
        for prompt in prompts:
            start = question_start(task, doc, prompt)
            demonstrations = prompt[:start]
            assert demonstrations.endswith(delimiter) and demonstrations.count(delimiter) == 3
            assert delimiter not in prompt[start:]


@pytest.mark.slow
def test_context_protocol_budgets_the_demonstrations_only(tmp_path, data_dir):
    """PIQA 2-shot on a tiny model: under ``context`` the budget applies to the demonstrations (shorter than the
    prompt the ``prefill`` protocol compresses), and the scores differ from prefill's."""
    records = {}
    for protocol in ("prefill", "context"):
        config = make_config(
            data_dir, tmp_path / protocol, model="tiny-llama", task="piqa", limit=6, num_fewshot=2,
            policy="h2o", budget=0.2, protocol=protocol,
        )  # fmt: skip
        records[protocol] = run(config, tmp_path / "work")
    prefill, context = records["prefill"]["capacity"], records["context"]["capacity"]
    assert 0 < context["length_mean"] < prefill["length_mean"]
    assert context["capacity_mean"] < prefill["capacity_mean"]


def test_context_protocol_needs_demonstrations_for_log_likelihood_tasks(tmp_path, data_dir):
    from h2o_eval.errors import ConfigError
    from h2o_eval.run import validate

    with pytest.raises(ConfigError, match="protocol=context compresses .* use num_fewshot >= 1"):
        validate(make_config(data_dir, tmp_path, task="piqa", protocol="context", policy="h2o"))
