"""Shared fixtures. Tests never touch the network: hub and W&B are offline, data comes from shared/data."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

# No GPU on any machine of this project: Triton kernels run in Triton's interpreter (set before they are defined).
for _key, _value in {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "WANDB_MODE": "offline",
    "TRITON_INTERPRET": "1",
}.items():
    os.environ.setdefault(_key, _value)

import pytest  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402


def _interpreted_dot_of_bfloat16(create_dot):
    """Triton's interpreter stores bfloat16 as its uint16 bits and ``tl.dot`` multiplies those bits (only 8-bit
    floats are converted first; triton-lang/triton#11584, unsupported upstream). Widen bfloat16 operands to float32
    first, as a tensor core multiplies them: exact products, float32 sums."""

    def widened(builder, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = (builder.cast_impl(x, tl.float32) if x.dtype.scalar == tl.bfloat16 else x for x in (a, b))
        return create_dot(builder, a, b, d, input_precision, max_num_imprecise_acc)

    return widened


interpreter.InterpreterBuilder.create_dot = _interpreted_dot_of_bfloat16(interpreter.InterpreterBuilder.create_dot)

# Under pytest-xdist (-n N) each worker takes its share of the cores, torch's and numba's kernels alike (numba's
# OpenMP threads otherwise default to every core, and spin between kernels), so N workers do not oversubscribe them.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    from h2o_eval import threads

    threads.apply(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

from h2o_eval.eviction import Chunk  # noqa: E402
from h2o_eval.policies import POLICIES, Rule, configured_policy, example_policy  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# Every tiny random family (conf/model/tiny-*.yaml); tiny-gemma3's sliding layers (window 8) are crossed by every
# test sequence.
TINY = [
    "tiny-llama",
    "tiny-llama3",
    "tiny-mistral",
    "tiny-qwen2",
    "tiny-qwen3",
    "tiny-phi3",
    "tiny-gemma3",
    "tiny-opt",
    "tiny-gpt-neox",
    "tiny-gpt2",
]
DATA_DIR = Path(os.environ.get("H2O_EVAL_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def data_dir() -> Path:
    if not (DATA_DIR / "copa" / "validation.jsonl").is_file():
        pytest.fail(f"task data not found under {DATA_DIR}: set H2O_EVAL_DATA to the shared/data folder")
    return DATA_DIR


@pytest.fixture
def commit_lands_during_the_run(monkeypatch):
    """``results.git_commit`` answers commit "started" until the model has loaded, then "landed" (as when a commit
    lands while a long run computes)."""
    from h2o_eval import models, results

    head = {"commit": "started", "dirty": False}
    real_load = models.load_model

    def load_then_land(*args, **kwargs):
        loaded = real_load(*args, **kwargs)
        head["commit"] = "landed"
        return loaded

    monkeypatch.setattr(results, "git_commit", lambda: dict(head))
    monkeypatch.setattr(models, "load_model", load_then_land)


def make_config(data_dir: Path | None, results_dir: Path, **overrides) -> dict:
    """A resolved run config as the CLI would build it, composed by Hydra from conf/ with ``overrides``."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    args = [f"{key}={value}" for key, value in overrides.items()]
    args += [f"results_dir={results_dir}", "wandb.mode=disabled"]
    if data_dir is not None:
        args.append(f"data_dir={data_dir}")
    with initialize_config_module(config_module="h2o_eval.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=args)
    return OmegaConf.to_container(cfg, resolve=True)


# Policies whose cases of a generic suite run by default: one of each kind of rule (accumulated, latest, window with
# pooling, per-head budgets, no votes, extra passes); the others' cases are marked ``slow``.
FAST_POLICIES = ("full", "h2o", "tova", "snapkv", "adakv", "streaming", "knorm", "kvzip")


def fast_sample(cases: list, fast) -> list:
    """``cases`` for ``parametrize``: those for which ``fast(case)`` holds run in the default (fast) suite, the
    others are marked ``slow`` (``python -m pytest -m slow`` runs them; ``-m 'slow or not slow'`` runs all)."""
    return [case if fast(case) else pytest.param(*_args(case), marks=pytest.mark.slow) for case in cases]


def _args(case) -> tuple:
    return tuple(case.values) if hasattr(case, "values") else case if isinstance(case, tuple) else (case,)


@functools.cache
def _record_settings(task: str, policy: str, budget: float | int, protocol: str, overrides: tuple) -> str:
    config = make_config(
        None, Path("results"), model="tiny-llama", task=task, policy=policy, budget=budget, protocol=protocol,
        **dict(overrides),
    )  # fmt: skip
    return json.dumps({"config": config, "policy_params": configured_policy(config).describe(), "data": "hub"})


def record_settings(task: str, policy: str, budget: float | int, protocol: str = "simulate", **overrides) -> dict:
    """What a record holds of its setting (``config``, ``policy_params``, ``data``), for a record written by a test:
    the config ``python -m h2o_eval model=tiny-llama task=... policy=... budget=... protocol=...`` with
    ``overrides`` (``**{"policy.window": 8}``) would run."""
    return json.loads(_record_settings(task, policy, budget, protocol, tuple(sorted(overrides.items()))))


def registered(protocol: str, *, cache: bool = True, evicting: bool = False, passes: bool = True) -> list[str]:
    """Every registered policy that exists in ``protocol``, as its class declares; with ``cache``, only those that
    run as a cache; with ``evicting``, only those whose example evicts from a 64-token sequence at a budget of 0.2;
    without ``passes``, only those that need no extra passes before compressing and do not re-rotate the keys they
    kept (so run in one forward, as ``patch`` runs them). The generic suites iterate over these, so a new policy
    (its file and registry entry) takes part in every one."""
    names = []
    for name, cls in POLICIES.items():
        policy = example_policy(name, 0.2)
        if protocol not in cls.protocols or (cache and not policy.has_cache):
            continue
        if not passes and (policy.rehearses or policy.rerotates):
            continue
        if evicting and policy.capacity(64) >= 64:
            continue
        names.append(name)
    return names


RULES = {
    "h2o": Rule(votes="all"),
    "tova": Rule(votes="all", combine="replace"),  # per KV head
    "tova_layer": Rule(votes="all", combine="replace", heads="layer"),  # one token set per layer (the authors')
    "static": Rule(),  # scores that need no attention (random, key norm), or recency alone
    "snapkv": Rule(votes="window", window=3, pooling="max", kernel_size=3, grows=True),
    "snapkv_avg": Rule(votes="window", window=2, pooling="avg", kernel_size=5, grows=True),
    "adakv": Rule(votes="window", window=2, pooling="max", kernel_size=3, grows=True, safeguard=0.3),
    "adakv_h2o": Rule(votes="all", safeguard=0.5),
}
# Every registered policy's own rule (its example's) takes part in the mechanism's suites too; but a threshold's
# (dms), whose example drops nothing, and whose compression tests/test_threshold.py proves against the row loop.
for _name in POLICIES:
    _rule = example_policy(_name).rule
    if example_policy(_name).has_cache and _rule not in RULES.values() and _rule.threshold is None:
        RULES[f"policy:{_name}"] = _rule


def make_chunk(batch, q_heads, kv_heads, n, state, rule, prefill, padding, seed=0, dim=16, dtype=torch.float32):
    """Random q/k/v and a Chunk: ``state`` held slots with random scores, ``n`` new tokens (``padding``: none,
    left on the first sequence, right on the last), capacities varying by sequence and KV head (ragged heads),
    recent windows and sinks varying by sequence, the first ``prefill`` rows prompt rows (``state`` must then be
    0). New tokens start with random scores when the rule takes no votes (as key scores would), else 0. A rule
    whose ``heads`` share one token set gets the same capacities and state scores in every KV head."""
    gen = torch.Generator().manual_seed(seed)
    slots = state + n
    query = torch.randn(batch, q_heads, n, dim, generator=gen).to(dtype)
    key = torch.randn(batch, kv_heads, slots, dim, generator=gen).to(dtype)
    value = torch.randn(batch, kv_heads, slots, dim, generator=gen).to(dtype)
    arriving = torch.ones(batch, n, dtype=torch.bool)
    if padding == "left" and n > 2:
        arriving[0, :2] = False
    elif padding == "right" and n > 2:
        arriving[-1, -3:] = False
    new_position = state + arriving.cumsum(-1) - 1
    position = torch.cat([torch.arange(state).expand(batch, state), new_position.clamp(min=0)], -1)
    position = position.unsqueeze(1).expand(batch, kv_heads, slots).contiguous()
    fresh = torch.rand(batch, kv_heads, n, generator=gen) if rule.votes == "none" else torch.zeros(batch, kv_heads, n)
    scores = torch.cat([torch.rand(batch, kv_heads, state, generator=gen), fresh], -1)
    held = torch.zeros(batch, kv_heads, slots, dtype=torch.bool)
    held[..., :state] = True
    capacity = torch.tensor([[max(state, 3) + b + 2 * (h % 2) for h in range(kv_heads)] for b in range(batch)])
    if rule.heads == "layer":
        scores, capacity = scores[:, :1].expand_as(scores).contiguous(), capacity[:, :1].expand_as(capacity)
    chunk = Chunk(
        held=held,
        arriving=arriving,
        position=position,
        scores=scores,
        capacity=capacity,
        recent=torch.tensor([1 + b % 2 for b in range(batch)]),
        sinks=torch.tensor([b % 2 for b in range(batch)]),
        prefill=torch.full((batch,), min(prefill, n)),
        rule=rule,
        scaling=dim**-0.5,
    )
    return query, key, value, chunk
