"""Threshold budgets (``dms``, kvpress's DMSPress): the policy on a tiny Llama against a plain re-implementation
written here (a full cache whose dropped keys are masked, per head, as kvpress masks them), the mechanism's
threshold compression against its row loop, the refusals and the ``threshold`` setting. kvpress 0.5.5 itself is
compared on SmolLM2 by ``h2o_eval.benchmarks.kvpress_compare --presses dms_knorm,...`` (docs/policies.md)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_chunk
from test_eviction import assert_same_result
from transformers import AttentionInterface, DynamicCache

from h2o_eval import EvictionCache, load_model, make_policy
from h2o_eval.capacity import CapacityLog
from h2o_eval.chunks import attend_chunk
from h2o_eval.errors import ConfigError
from h2o_eval.eviction import attend_chunk_reference
from h2o_eval.layouts import Ragged
from h2o_eval.policies import Rule, configured_policy
from h2o_eval.settings import policy_departures

THRESHOLD = -0.6  # about the median of minus the tiny Llama's key norms: roughly half the old tokens go
WINDOW = 8
DROPPED: dict[int, torch.Tensor] = {}  # per layer [B, Hkv, K] the keys the re-implementation masks


def masked_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal attention over a full cache less the keys ``DROPPED`` masks for this layer, per KV head."""
    batch, q_heads, n, _ = query.shape
    group, width = q_heads // key.shape[1], key.shape[2]
    logits = query @ key.repeat_interleave(group, 1).transpose(-1, -2) * scaling
    causal = torch.arange(width) <= (width - n + torch.arange(n)).view(-1, 1)
    dropped = DROPPED.get(module.layer_idx, torch.zeros(batch, key.shape[1], 0, dtype=torch.bool))
    dropped = torch.nn.functional.pad(dropped, (0, width - dropped.shape[-1]))
    seen = causal & ~dropped.repeat_interleave(group, 1).unsqueeze(2)
    probs = torch.softmax(logits.masked_fill(~seen, -torch.inf), -1)
    return (probs @ value.repeat_interleave(group, 1)).transpose(1, 2), None


AttentionInterface.register("dms_reference", masked_attention)


@pytest.fixture(scope="module")
def tiny():
    """The tiny Llama the harness runs, and a copy of it whose attention is :func:`masked_attention`."""
    plain = load_model("tiny-llama", device="cpu")[0]
    masked = load_model("tiny-llama", device="cpu")[0]
    masked.set_attn_implementation("dms_reference")
    return plain, masked


def reference(model, ids: torch.Tensor, stops: list[int], decoding: bool) -> tuple[list, list]:
    """The plain re-implementation: the prompt (up to the first of ``stops``) attends in full, then every token
    older than the window whose minus key norm is below the threshold is masked; with ``decoding`` the same at the
    end of every later forward (up to each next stop). Returns each forward's logits and the kept positions."""
    DROPPED.clear()
    cache, logits, start = DynamicCache(), [], 0
    for stop in stops:
        out = model(ids[:, start:stop], cache=cache, use_cache=True)
        logits.append(out.logits[:, -1])
        if start == 0 or decoding:
            for layer, state in enumerate(cache.layers):
                keys = state.keys  # [B, Hkv, K, D]
                gone = (torch.arange(keys.shape[2]) <= stop - 1 - WINDOW) & (-keys.float().norm(dim=-1) < THRESHOLD)
                before = DROPPED.get(layer, gone[..., :0])
                DROPPED[layer] = torch.nn.functional.pad(before, (0, gone.shape[-1] - before.shape[-1])) | gone
        start = stop
    every = [torch.nn.functional.pad(d, (0, ids.shape[1] - d.shape[-1])) for d in DROPPED.values()]
    kept = [[[(~d[b, h]).nonzero().flatten().tolist() for h in range(d.shape[1])] for b in range(d.shape[0])]
            for d in every]  # fmt: skip
    return logits, kept


@torch.no_grad()
@pytest.mark.parametrize("decoding", [False, True])
def test_threshold_equals_a_masked_full_cache_on_the_prompt_and_while_decoding(tiny, decoding):
    """A 30-token prompt, a 4-token question at once, then 6 decode steps: the logits of every forward and, per
    layer and KV head, the tokens held equal the re-implementation's; without ``decoding`` nothing goes after the
    prompt. Heads keep different numbers of tokens, and the bytes held follow what they hold."""
    ids = torch.randint(100, 4000, (2, 40), generator=torch.Generator().manual_seed(3))
    stops = [30, 34, *range(35, 41)]
    model, masked = tiny
    expected, kept = reference(masked, ids, stops, decoding)
    policy = make_policy("dms", base="knorm", threshold=THRESHOLD, sliding_window=WINDOW, decoding=decoding)
    cache = EvictionCache(model, policy, protocol="context")
    logits, start = [], 0
    for stop in stops:
        logits.append(model(ids[:, start:stop], cache=cache, use_cache=True).logits[:, -1])
        start = stop
        if stop == 30:
            after_prompt = [layer.held.sum(-1) for layer in cache.layers]
    for mine, theirs in zip(logits, expected, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    held = [
        [[sorted(layer.position[b, h][layer.held[b, h]].tolist()) for h in range(2)] for b in range(2)]
        for layer in cache.layers
    ]
    assert held == kept
    counts = torch.stack([layer.held.sum(-1) for layer in cache.layers])
    assert (counts.amax(-1) > counts.amin(-1)).any()  # heads hold different numbers
    assert (torch.stack(after_prompt) < 30).all()
    if not decoding:
        assert torch.equal(counts, torch.stack(after_prompt) + 10)
    realised = torch.stack(cache.realised())
    assert torch.equal(realised, torch.stack(after_prompt).float())
    log = CapacityLog()
    log.add(cache)
    shares = (torch.stack(after_prompt).float() / 30).mean((1, 2))  # per layer: over sequences and KV heads
    assert log.stats()["layer_kept_fraction_mean"] == pytest.approx(shares.tolist())
    assert log.stats()["kept_fraction_mean"] == pytest.approx(float(shares.mean()))


@torch.no_grad()
def test_dropped_slots_are_freed_when_the_layout_regrows(tiny):
    """While decoding, the bytes a layer holds follow what its heads hold at each regrowth, not every token seen:
    70 steps past a 40-token prompt at a threshold that drops almost everything keep the layer near its window."""
    model = tiny[0]
    policy = make_policy("dms", base="knorm", threshold=0.0, sliding_window=WINDOW, decoding=True)
    cache = EvictionCache(model, policy, protocol="context")
    ids = torch.randint(100, 4000, (1, 110), generator=torch.Generator().manual_seed(4))
    model(ids[:, :40], cache=cache, use_cache=True)
    for step in range(40, 110):
        model(ids[:, step : step + 1], cache=cache, use_cache=True)
    for layer in cache.layers:
        assert (layer.held.sum(-1) == WINDOW).all()  # every score (minus a norm) is below 0: the window stays
        rows = layer.slots.keys.shape[1]
        assert rows <= 2 * (WINDOW + 64) + 1, rows  # each head's window and a bucket of room, not 110 tokens


@pytest.mark.parametrize("padding", ["none", "left", "right"])
def test_threshold_compression_equals_the_row_loop(padding):
    """The mechanism's threshold compression (vectorised) equals the definition's single evictions: every
    unprotected token below the threshold goes, whatever C, and nothing is evicted after the prompt."""
    rule = Rule(grows=True, threshold=0.5)
    query, key, value, chunk = make_chunk(3, 8, 2, 24, 0, rule, 16, padding)
    expected = attend_chunk_reference(query, key, value, chunk)
    assert_same_result(attend_chunk(query, key, value, chunk), expected, chunk)
    assert (expected.kept < 16).any() and (expected.kept > chunk.capacity).any()


def test_bad_thresholds_and_bases_are_refused_in_one_line(tiny):
    cases = [
        ({"base": "knorm"}, "threshold=None"),
        ({"base": "knorm", "threshold": "low"}, "threshold='low'"),
        ({"base": "local", "threshold": 0.1}, "ranks no tokens"),
        ({"base": "adakv", "threshold": 0.1}, "by budget"),
        ({"base": "snapkv", "threshold": 0.1, "decoding": True}, "per-token key scores"),
        ({"base": "knorm", "threshold": 0.1, "sliding_window": -1}, "sliding_window=-1"),
    ]
    for params, fragment in cases:
        with pytest.raises(ConfigError, match=fragment) as error:
            make_policy("dms", **params)
        assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="use decoding=evict"):
        EvictionCache(tiny[0], make_policy("dms", threshold=0.1, decoding=True), protocol="context", decoding="grow")
    with pytest.raises(ConfigError, match="give threshold"):
        Rule(grows=True, drops=True)


def test_the_threshold_setting_wraps_the_configured_policy():
    config = {"policy": {"name": "snapkv", "window": 8}, "budget": 0.2, "rounding": "up", "threshold": 0.01}
    policy = configured_policy(config)
    assert policy.name == "dms" and policy.base.name == "snapkv" and policy.base.window == 8
    assert policy.threshold == 0.01 and policy.sliding_window == 128 and not policy.decoding
    assert configured_policy(dict(config, threshold=None)).name == "snapkv"
    # Its record names what departs from the base's own YAML and dms's, not every parameter of the base.
    departures = {"policy.threshold": 0.01, "policy.base.window": 8, "policy.base.name": "snapkv"}
    assert policy_departures(policy.describe()) == departures
    with pytest.raises(ConfigError, match="ranks no tokens"):
        configured_policy(dict(config, policy={"name": "streaming"}))


def test_policy_dms_from_its_yaml_builds_with_its_own_threshold_and_refuses_a_second(tmp_path):
    """``policy=dms`` names its threshold in its YAML (the reasoning board's ``policy=reasoning/dms`` too): the run's
    config builds it, and a ``threshold=`` beside it is refused in one line."""
    from conftest import make_config

    for option, threshold, decoding in (("dms", -5.0, False), ("reasoning/dms", -18.0, True)):
        policy = configured_policy(make_config(None, tmp_path, policy=option))
        assert (policy.name, policy.base.name, policy.threshold, policy.decoding) == (
            "dms",
            "knorm",
            threshold,
            decoding,
        )
    with pytest.raises(ConfigError, match="policy=dms has its own: give one of them"):
        configured_policy(make_config(None, tmp_path, policy="dms", threshold=-2.0))


@torch.no_grad()
def test_a_threshold_keeps_the_same_tokens_whatever_the_budget_given(tiny):
    """Reference: dms over a Compactor built at budget 1.0 (kvpress's DMSPress over a CompactorPress at its default
    ratio of 0), whose scores blend by the ratio; implementation: dms built at budgets 0.3 and 0.9. Each keeps the
    reference's tokens in every layer and KV head, and says budget 1.0."""
    from h2o_eval.policies.dms import DMS

    ids = torch.randint(5, tiny[0].config.vocab_size, (1, 400), generator=torch.Generator().manual_seed(3))

    def kept(policy):
        cache = EvictionCache(tiny[0], policy, protocol="context")
        tiny[0](ids, cache=cache, use_cache=True)
        return [layer.position[layer.held].sort().values.tolist() for layer in cache.layers]

    reference = kept(DMS(base=make_policy("compactor", 1.0), threshold=0.5))
    assert reference != kept(DMS(base=make_policy("compactor", 0.3), threshold=0.5)), "the ratio should matter here"
    for budget in (0.3, 0.9):
        policy = make_policy("dms", budget, base="compactor", threshold=0.5)
        assert policy.budget == policy.base.budget == 1.0 and kept(policy) == reference


def test_threshold_runs_that_differ_only_in_budget_are_one_record(data_dir, tmp_path):
    from conftest import make_config

    from h2o_eval.run import validate

    settings = {"model": "tiny-llama", "task": "niah_single_1", "task.length": 600, "policy": "knorm", "threshold": -3}
    specs = [validate(make_config(data_dir, tmp_path, **settings, budget=budget)) for budget in (0.2, 0.5)]
    assert specs[0].path == specs[1].path and "__b1.0__" in specs[0].path.name
    assert specs[0].config["budget"] == 1.0


def test_records_without_a_threshold_keep_the_identity_they_had_before_the_setting():
    from conftest import make_config

    from h2o_eval import results

    config = make_config(None, "results", model="tiny-llama", task="copa", policy="knorm", protocol="prefill")
    before = {key: value for key, value in config.items() if key != "threshold"}  # a record made before it
    assert config["threshold"] is None and results.identity(config) == results.identity(before)
    assert results.identity(dict(config, threshold=-3.0)) != results.identity(config)


def test_reports_place_a_threshold_run_at_the_share_it_kept(tmp_path):
    """A threshold run has no budget: its row names its threshold and sits at the share it kept; a leaderboard
    tables it apart, at the mean of its tasks' shares (thresholds -3 and -2: 0.3/0.4 and 0.6/0.8 kept, compression
    ratios 0.65 and 0.3), and its figure draws one base's thresholds as one line through those ratios."""
    import json

    from test_plot import long_record

    from h2o_eval import plot, results
    from h2o_eval.reports import headline, leaderboards, tables

    for task, kept in (("niah_single_2", 0.3), ("vt", 0.4)):
        long_record(tmp_path, task, "full", 1.0, [[1]] * 4)
        long_record(tmp_path, task, "knorm", 0.5, [[1]] * 3 + [[0]])
        for threshold, share, budget in ((-3.0, kept, 0.2), (-2.0, 2 * kept, 0.1)):
            long_record(tmp_path, task, "knorm", budget, [[1]] * 2 + [[0]] * 2, settings={"threshold": threshold})
            path = tmp_path / f"{task}_knorm_{budget}_context_4096.json"
            results.write_record(path, {**json.loads(path.read_text()), "capacity": {"kept_fraction_mean": share}})
    rows = tables.table(results.load_records(tmp_path))
    assert sorted((r["task"], r["policy"], tables.position(r)) for r in rows if r["kept"] is not None) == [
        ("niah_single_2@4096", "knorm (threshold=-2.0)", 0.6),
        ("niah_single_2@4096", "knorm (threshold=-3.0)", 0.3),
        ("vt@4096", "knorm (threshold=-2.0)", 0.8),
        ("vt@4096", "knorm (threshold=-3.0)", 0.4),
    ]
    assert {r["threshold"] for r in rows} == {None, "knorm (threshold)"}
    plot.main([str(tmp_path), "--leaderboard", "--out", str(tmp_path / "plots")])
    table = (tmp_path / "plots" / "leaderboard_tiny-llama_context_4096.md").read_text().splitlines()

    def cells(lines):
        return [[cell.strip().split(" [")[0] for cell in line.strip().strip("|").split("|")] for line in lines]

    assert cells(table[2:6]) == [["policy", "0.5"], ["---", "---:"], ["full (ceiling)", "100.0"], ["knorm", "75.0"]]
    assert cells(table[-4:]) == [
        ["policy", "compression ratio realised", "score"],
        ["---", "---:", "---:"],
        ["knorm (threshold=-2.0)", "0.300", "50.0"],
        ["knorm (threshold=-3.0)", "0.650", "50.0"],
    ]
    ((key, group),) = leaderboards.leaderboards(headline.long_context(rows, tmp_path)).items()
    axes = leaderboards.leaderboard_figure(key, group).axes[0]
    curves = {container.get_label(): container.lines[0] for container in axes.containers}
    assert sorted(curves) == ["knorm", "knorm (threshold)"]
    assert (
        list(curves["knorm (threshold)"].get_xdata()) == [0.3, 0.65]
        and curves["knorm (threshold)"].get_linestyle() == "-."
    )
    assert [tick.get_text() for tick in axes.get_xticklabels()] == ["0.5"]


@torch.no_grad()
def test_a_decode_step_that_drops_reads_no_tensor_on_the_host(tiny):
    """Dropping while decoding is tensor arithmetic: the steps after the prompt (within the room laid out after it)
    read nothing on the host, as every policy's (tests/test_host_sync.py)."""
    from test_host_sync import decode_reads

    model, tokenizer = tiny[0], load_model("tiny-llama", device="cpu")[1]
    prompt = torch.randint(5, 400, (2, 40), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(prompt)
    mask[0, :5] = 0
    policy = make_policy("dms", threshold=THRESHOLD, sliding_window=WINDOW, decoding=True)
    cache = EvictionCache(model, policy, protocol="context", kernels="torch")
    assert decode_reads(model, tokenizer, cache, prompt, mask) == []
    assert all(isinstance(layer.layout, Ragged) for layer in cache.layers)  # the ragged layout, room included


def test_make_policy_takes_a_threshold_wherever_it_takes_a_budget():
    """``make_policy(name, threshold=T)`` is ``dms`` over ``name`` at T (the CLI's ``threshold=``); a threshold that
    is not a number is refused naming what was given, and dms's own threshold stays its own."""
    assert make_policy("knorm", threshold=-2.0) == make_policy("dms", base="knorm", threshold=-2.0)
    assert make_policy("snapkv", threshold=0.1, window=4).base == make_policy("snapkv", 1.0, window=4)
    with pytest.raises(ConfigError, match=r"^threshold='abc': use a number"):
        make_policy("knorm", threshold="abc")
    with pytest.raises(ConfigError, match=r"^threshold=... makes policy 'adakv' the base of dms, and adakv wraps"):
        make_policy("adakv", threshold=0.1, base="snapkv")
