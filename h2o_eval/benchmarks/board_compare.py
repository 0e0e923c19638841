"""The one-question leaderboard side by side with kvpress 0.5.5's own pipeline: the same RULER documents and cells
through ``python -m h2o_eval.grid +experiment=kv_leaderboard`` and through kvpress's
``KVPressTextGenerationPipeline``, in interleaved rounds, one thread each.

    python -m h2o_eval.benchmarks.board_compare --kvpress KVPRESS --data-dir ../shared/data \\
        [--task niah_single_2] [--documents 1] [--rounds 2] [--model smollm2-135m] [--policy full,knorm] [--budget 0.5]
    python -m h2o_eval.benchmarks.board_compare --kvpress KVPRESS --task niah_single_1 --model shape-llama-3-8b \\
        --device cuda --new-tokens 32 --kvpress-budget 0.5      # on a GPU (results/gpu/board.sh)

KVPRESS is the folder kvpress and its transformers are installed in, as ``kvpress_compare`` installs them. The grid
runs the preset's cells (narrowed by ``--policy`` and ``--budget``, given as the grid takes them); kvpress runs those
of them that are entries of its board (:data:`BOARD`: each preset policy's press as kvpress's
``evaluation/evaluate_registry.py`` builds it; ``--kvpress-budget``: at those budgets only, its cost per cell not
depending on how many run), at compression ratio 1 - budget, its pipeline once per document and cell, as its
``evaluate.py`` runs it (``torch.manual_seed(42)`` once). A cell kvpress's pipeline fails (PyramidKV's layers of
different lengths need flash attention, absent on a CPU) is left out of its time and of the comparison.

Prints, per round, the CPU seconds per document and cell of each side (the grid's from its records'
``cpu_seconds``, which leave the model's load out; kvpress's around its pipeline calls), their ratio, and how many
of the cells both ran give the same predictions on every document (naming those that do not). With ``--device
cuda`` each side runs on the GPU in bfloat16 and the seconds are wall seconds (the records' ``wall_seconds``; the
pipeline calls', the device synchronised). A random model (``shape-llama-3-8b``: Llama-3-8B's shapes) is built in
kvpress's process from its config and seed, as h2o_eval builds it; ``--new-tokens`` fixes the answers' length at
most (a random model seldom ends one), and a task that reads no data file (``niah_single_1``: a noise haystack)
needs no ``--data-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# The preset's policies that are entries of kvpress's board, as kvpress's registry builds each press (None: no press).
BOARD = {
    "full": None,
    "kvzip": "KVzipPress()",
    "kvpress/expected_attention": "AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))",
    "keydiff": "KeyDiffPress()",
    "kvpress/snapkv": "SnapKVPress()",
    "kvpress/pyramidkv": "PyramidKVPress()",
    "kvpress/adakv_compactor": "AdaKVPress(CompactorPress())",
    "knorm": "KnormPress()",
    "streaming": "StreamingLLMPress()",
    "tova": "TOVAPress()",
    "kvpress/random": "RandomPress()",
}


def grid_side(args: argparse.Namespace, out: Path) -> tuple[float, int, dict[tuple[str, float], list[str]]]:
    """The grid on the documents: its evaluation's CPU seconds (the records' ``cpu_seconds``, summed), its cells,
    and each cell's predictions by (preset policy, budget)."""
    from h2o_eval.benchmarks.costs import cell, described
    from h2o_eval.results import load_records

    command = [sys.executable, "-m", "h2o_eval.grid", "+experiment=kv_leaderboard", f"model={args.model}",
               f"task={args.task}", f"limit={args.documents}", "threads=1", f"results_dir={out}", "overwrite=true",
               "wandb.mode=disabled", *args.narrow, *settings(args)]  # fmt: skip
    print(f"grid: {' '.join(command[3:])}", file=sys.stderr, flush=True)
    done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if done.returncode:
        raise SystemExit(f"error: the grid failed (exit status {done.returncode}):\n{done.stderr[-3000:]}")
    options = {cell(described(option), 0): option for option in BOARD}  # the preset's name of a policy's parameters
    records = list(load_records(out))
    predictions = {}
    for record in records:
        outputs = [json.loads(line) for line in (out / record["outputs"]).read_text().splitlines()]
        option = options.get(cell(record["policy_params"], 0), record["policy"])
        key = (option, 1.0 if record["policy"] == "full" else record["budget"])
        predictions[key] = [o["prediction"] for o in sorted(outputs, key=lambda o: o["document"])]
    spent = "wall_seconds" if args.device == "cuda" else "cpu_seconds"
    return sum(r[spent] for r in records), len(records), predictions


def settings(args: argparse.Namespace) -> list[str]:
    """The grid's settings besides the preset's and the cells': the data, the device, the answers' length."""
    device = ["device=cuda", "dtype=bfloat16"] if args.device == "cuda" else []
    data = [f"data_dir={args.data_dir.resolve()}"] if args.data_dir else []
    length = [f"task.length={args.length}"] if args.length else []
    return data + device + length + ([f"task.max_new_tokens={args.new_tokens}"] if args.new_tokens else [])


def kvpress_side(args: argparse.Namespace, cells: list[tuple[str, float]]) -> tuple[float, dict]:
    """kvpress's pipeline on the documents for ``cells`` (in a subprocess whose path holds ``--kvpress``): its
    seconds (CPU, or wall on a GPU) and each cell's predictions."""
    from omegaconf import OmegaConf

    from h2o_eval.names import compose
    from h2o_eval.ruler import fit_counter, generate

    config = OmegaConf.to_container(
        compose(["+experiment=kv_leaderboard", f"model={args.model}", f"task={args.task}", *settings(args)]),
        resolve=True,
    )
    from h2o_eval.models import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    task = config["task"]
    documents = generate(task, count_tokens=fit_counter(task, tokenizer), data_dir=args.data_dir, limit=args.documents)
    new_tokens = args.new_tokens or task["max_new_tokens"]
    with tempfile.TemporaryDirectory() as scratch:
        stub = Path(scratch) / "stub" / "datasets"
        stub.mkdir(parents=True)
        (stub / "__init__.py").write_text("def load_dataset(*args, **kwargs):\n    raise RuntimeError('no hub')\n")
        job, out = Path(scratch) / "job.json", Path(scratch) / "out.json"
        job.write_text(json.dumps({
            **model_job(args.model), "max_new_tokens": new_tokens, "device": args.device,
            "cells": [[BOARD[policy], 1 - budget] for policy, budget in cells],
            "documents": [{"context": d["context"], "questions": d["questions"]} for d in documents],
        }))  # fmt: skip
        env = dict(os.environ, PYTHONPATH=f"{args.kvpress}{os.pathsep}{stub.parent}", TRANSFORMERS_VERBOSITY="error",
                   HF_HUB_OFFLINE="1", HF_HUB_DISABLE_PROGRESS_BARS="1", OMP_NUM_THREADS="1")  # fmt: skip
        print(f"kvpress: {len(cells)} cells x {len(documents)} documents", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, __file__, "--serve", str(job), str(out)], env=env, check=True)
        found = json.loads(out.read_text())
    return found["seconds"], {cell: answers for cell, answers in zip(cells, found["answers"], strict=True) if answers}


def model_job(name: str) -> dict[str, Any]:
    """How kvpress's process gets the model: the folder it loads (and its tokenizer's), or for a random model the
    config and seed h2o_eval builds it from (:func:`job_model`) and SmolLM2's tokenizer folder."""
    from h2o_eval import models
    from h2o_eval.benchmarks.kvpress_compare import model_folder

    spec = models.registry().get(name)
    if spec is None or spec["source"] != "random":
        folder = model_folder(name)
        return {"folder": folder, "tokenizer": folder}
    tokenizer = models.smollm2_tokenizer()
    config = models.random_config(spec["config"], tokenizer).to_dict()
    return {"config": config, "seed": spec.get("seed", 0), "tokenizer": tokenizer.name_or_path}


def job_model(job: dict[str, Any]) -> Any:
    """The job's model in eval mode, on its device: loaded from its folder (float32 on the CPU), or built from its
    config with its seed's random weights as h2o_eval builds a random model (bfloat16 on a GPU, float32 on the
    CPU)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from h2o_eval.models import seeded_model

    device = torch.device(job["device"])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if "folder" in job:
        return AutoModelForCausalLM.from_pretrained(job["folder"], dtype=dtype).to(device).eval()
    params = dict(job["config"])
    config = AutoConfig.for_model(params.pop("model_type"), **params)
    return seeded_model(config, job["seed"], dtype, device).eval()


def serve(job_path: Path, out_path: Path) -> None:
    """kvpress's side, in kvpress's environment: its pipeline on every document for every cell."""
    import kvpress
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    job = json.loads(job_path.read_text())
    model = job_model(job)
    tokenizer = AutoTokenizer.from_pretrained(job["tokenizer"])
    pipe = kvpress.KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer, device=job["device"])
    cuda = job["device"] == "cuda"
    clock = time.perf_counter if cuda else time.process_time
    torch.manual_seed(42)  # evaluate.py's seed, once per run
    answers, seconds = [], 0.0
    for expression, ratio in job["cells"]:
        press = None if expression is None else eval(expression, vars(kvpress))  # BOARD's presses, named by us
        if press is not None:
            press.compression_ratio = ratio
        own, began = [], clock()
        try:
            for document in job["documents"]:
                [question] = document["questions"]
                found = pipe(document["context"], question=question["question"],
                             answer_prefix=question["answer_prefix"], press=press,
                             max_new_tokens=job["max_new_tokens"])  # fmt: skip
                own.append(found["answer"])
        except RuntimeError as error:  # PyramidKV's uneven layers need flash attention, which a CPU lacks
            print(f"kvpress fails: {expression} at {ratio}: {str(error)[:120]}", file=sys.stderr, flush=True)
            answers.append(None)
            continue
        if cuda:
            torch.cuda.synchronize()
        seconds += clock() - began
        answers.append(own)
    out_path.write_text(json.dumps({"seconds": seconds, "answers": answers}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kvpress", type=Path)
    parser.add_argument("--data-dir", type=Path)
    parser.add_argument("--task", default="niah_single_2")
    parser.add_argument("--documents", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--policy", help="the grid's policy sweep, narrowed (default: the preset's)")
    parser.add_argument("--budget", help="the grid's budget sweep, narrowed (default: the preset's)")
    parser.add_argument("--kvpress-budget", type=float, nargs="+", help="kvpress's cells at these budgets only")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--new-tokens", type=int, help="the answers' length at most (default: the task's)")
    parser.add_argument("--length", type=int, help="the documents' length in tokens (default: the preset's, 4096)")
    parser.add_argument("--serve", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(*args.serve)
        return
    if args.kvpress is None:
        parser.error("give --kvpress (and --data-dir where the task reads data files)")
    args.narrow = [f"{key}={value}" for key, value in (("policy", args.policy), ("budget", args.budget)) if value]
    where = "on the GPU, wall" if args.device == "cuda" else "one thread each side, CPU"
    print(f"{args.model}, {args.task}, {args.documents} document(s), {where} seconds")
    print(f"| round | side | cells | {where.split(', ')[-1]} s per document and cell | ratio | same predictions |")
    print("|---|---|---:|---:|---:|---|")
    for round_ in range(1, args.rounds + 1):
        with tempfile.TemporaryDirectory() as out:
            seconds, count, mine = grid_side(args, Path(out))
        board = sorted(
            cell for cell in mine if cell[0] in BOARD and (not args.kvpress_budget or cell[1] in args.kvpress_budget)
        )
        theirs_seconds, theirs = kvpress_side(args, board)
        ours = seconds / (count * args.documents)
        per = theirs_seconds / (len(theirs) * args.documents)
        differ = [cell for cell in theirs if mine[cell] != [answer.strip() for answer in theirs[cell]]]
        named = f" (not {', '.join(f'{name} at {budget:g}' for name, budget in differ)})" if differ else ""
        print(f"| {round_} | h2o_eval grid | {count} | {ours:.2f} | | |")
        ratio = f"{per / ours:.1f}x"
        same = f"{len(theirs) - len(differ)} of {len(theirs)}{named}"
        print(f"| {round_} | kvpress pipeline | {len(theirs)} | {per:.2f} | {ratio} | {same} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
