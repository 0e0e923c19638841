"""Records as runs write them, made by hand for the report tests: a record of one setting and score, and a
long-context record with its per-question outputs."""

from __future__ import annotations

from conftest import record_settings

from h2o_eval import results


def fake_record(
    task, policy, budget, value, created="2026-11-22T00:00:00+00:00", protocol="simulate", settings=None, **extra
):
    """A record of ``task`` run with ``policy`` at ``budget`` scoring ``value``; ``settings``: its config's
    overrides (``{"task.length": 1024}``)."""
    metric = "rouge2" if task == "xsum" else "acc"
    return {
        **record_settings(task, policy, budget, protocol, **(settings or {})),
        "task": task,
        "model": "tiny-llama",
        "policy": policy,
        "budget": budget,
        "protocol": protocol,
        "num_fewshot": 0,
        "limit": 10,
        "n_samples": 10,
        "created": created,
        "metrics": {metric: value, f"{metric}_stderr": 0.05, **extra},
    }


def long_record(
    folder, task, policy, budget, per_document, protocol="context", length=4096, metric=None, limit=None, settings=None,
    name=None,
):  # fmt: skip
    """A long-context record whose outputs hold each document's questions (``per_document``: a list of score
    lists), with ids "<document>/<question>" as a haystack of several questions writes them; ``settings``: its
    config's other overrides; ``name``: told apart from records of the same task, policy and budget."""
    metric = metric or ("string_match_part" if task.startswith("qa") else "string_match_all")
    outputs = [
        {"id": f"{d}/{q}", "document": d, "depth": 50.0, "scores": {metric: float(score)}}
        for d, scores in enumerate(per_document)
        for q, score in enumerate(scores)
    ]
    name = f"{task}_{policy}_{budget}_{protocol}_{length}" + (f"_{name}" if name is not None else "")
    results.write_jsonl(folder / f"{name}.outputs.jsonl", outputs)
    record = fake_record(
        task, policy, budget, 0.0, protocol=protocol, settings={"task.length": length, **(settings or {})}
    )
    record |= {"length": length, "limit": limit, "n_samples": len(outputs), "outputs": f"{name}.outputs.jsonl"}
    record["metrics"] = {metric: sum(o["scores"][metric] for o in outputs) / len(outputs)}
    results.write_record(folder / f"{name}.json", record)
