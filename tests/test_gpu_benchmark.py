"""python -m h2o_eval.benchmarks.gpu: its measurements run on the CPU with a tiny model, its table, its refusals."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from h2o_eval.benchmarks import gpu
from h2o_eval.models import load_model
from h2o_eval.policies import make_policy

CPU = ["--model", "tiny-llama", "--device", "cpu", "--dtype", "float32"]


@pytest.fixture
def no_model_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr("h2o_eval.models.load_model", refuse)


def test_without_cuda_the_benchmark_refuses_in_one_line_before_loading_a_model(monkeypatch, capsys, no_model_loading):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as stopped:
        gpu.main([])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: ") and "needs a CUDA device" in err


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--new-tokens", "1"], r"--new-tokens 1: .*at least 2"),
        (["--policies", "h2o_reference"], r"--policies h2o_reference: .*no cache"),
        (["--policies", "nonsense"], r"policy=nonsense: no policy of that name"),
        (["--lengths", "4000"], r"--lengths 4000 .* 2048 positions: use shorter prompts"),
        (["--batch", "0"], r"--batch integers >= 1 or max"),
        (["--rounds", "0"], r"--rounds 0: use at least 1"),
        (["--decoding", "keep"], r"decoding='keep': use one of evict, grow"),
        (["--budget", "1.5"], r"budget=1.5: use a fraction in \(0, 1\]"),
    ],
)
def test_bad_options_are_refused_in_one_line_before_the_model_loads(options, message, capsys, no_model_loading):
    with pytest.raises(SystemExit) as stopped:
        gpu.main([*CPU, *options])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: ")
    assert re.search(message, err), err


def settings(*names: str, graphs: bool = False) -> list[gpu.Setting]:
    return [
        gpu.Setting(name) if name.startswith("plain") else gpu.Setting(name, make_policy(name, 0.5), graphs)
        for name in names
    ]


def test_every_setting_is_measured_and_holds_the_kv_it_should():
    """plain ``generate`` (with and without cuDNN's attention), the full EvictionCache and H2O on a tiny model: every
    number measured and the same tokens from both plains; plain's DynamicCache holds every token but the last, the
    full cache at least as much, H2O at half the prompt about half as many."""
    model, tokenizer = load_model("tiny-llama", device="cpu")
    cpu = torch.device("cpu")
    chosen = settings("plain", "plain-nocudnn", "full", "h2o")
    rows = list(gpu.benchmark(model, tokenizer, lengths=[32], batches=[2], settings=chosen, new_tokens=3, device=cpu))
    assert [(r.length, r.batch, r.setting) for r in rows] == [(32, 2, s.name) for s in chosen]
    assert all(r.ttft > 0 and r.decode > 0 and r.peak_bytes is None and not r.note for r in rows)
    config = model.config
    entry = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4  # float32 K and V
    plain, nocudnn, full, h2o = (r.kv_bytes for r in rows)
    assert plain == nocudnn == 2 * (32 + 3 - 1) * entry and full >= plain
    assert h2o <= 2 * (16 + 1) * entry


def test_plain_without_cudnn_generates_plain_tokens():
    model, tokenizer = load_model("tiny-llama", device="cpu")
    ids = gpu.prompt_ids(model.config.vocab_size, 2, 24)
    made = {}
    for setting in settings("plain", "plain-nocudnn"):
        first = gpu.FirstToken(gpu.Clock(torch.device("cpu")))
        model.set_attn_implementation("sdpa")
        cache = gpu.generation(model, tokenizer, setting, ids, 4, first)
        made[setting.name] = [layer.keys.clone() for layer in cache.layers]
    assert all(torch.equal(a, b) for a, b in zip(made["plain"], made["plain-nocudnn"], strict=True))


def test_the_largest_batch_that_fits_is_found_by_doubling_then_bisecting():
    for largest in (0, 1, 2, 5, 8, 37, 4096):
        probes = []

        def fits(batch, largest=largest, probes=probes):
            probes.append(batch)
            return batch <= largest

        assert gpu.largest_batch(fits, limit=4096) == largest
        assert len(probes) <= 2 * 13
    assert gpu.largest_batch(lambda batch: True, limit=100) == 100


@pytest.mark.slow
def test_every_setting_at_every_length_and_batch_reads_the_same_prompt(monkeypatch):
    """A shorter or smaller setting reads the first tokens and rows of the one seeded prompt; plain comes first."""
    seen: dict[tuple[int, int, str], torch.Tensor] = {}

    def spy(model, tokenizer, setting, ids, new_tokens, device, decoding, warm):
        seen[ids.shape[1], ids.shape[0], setting.name] = ids.clone()
        return fake_measure(model, tokenizer, setting, ids, new_tokens, device, decoding, warm)

    monkeypatch.setattr(gpu, "measure", spy)
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=5000))
    cpu = torch.device("cpu")
    chosen = settings("plain", "full", "h2o")
    rows = list(gpu.benchmark(model, None, lengths=[16, 32], batches=[1, 2], settings=chosen, new_tokens=3, device=cpu))
    assert [(r.length, r.batch, r.setting) for r in rows] == [
        (length, batch, setting) for length in (16, 32) for batch in (1, 2) for setting in ("plain", "full", "h2o")
    ]
    widest = seen[32, 2, "plain"]
    assert len({tuple(row) for row in widest.tolist()}) == 2  # two different prompts in a batch
    for (length, batch, _), ids in seen.items():
        assert torch.equal(ids, widest[:batch, :length])


def test_rounds_interleave_the_settings_and_rows_give_their_median(monkeypatch):
    """Three rounds run A B A B A B, each setting warmed up in its first round only; a row is the median of its
    rounds, its range beside it."""
    order, rates = [], iter([10.0, 5.0, 30.0, 6.0, 20.0, 4.0])

    def timed(model, tokenizer, setting, ids, new_tokens, device, decoding, warm):
        order.append((setting.name, warm))
        return gpu.Row(ids.shape[1], ids.shape[0], setting.name, setting.graphs, [1.0], [next(rates)], None, 2**30)

    monkeypatch.setattr(gpu, "measure", timed)
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=5000))
    cpu = torch.device("cpu")
    chosen = settings("plain", "h2o")
    rows = list(
        gpu.benchmark(model, None, lengths=[8], batches=[1], settings=chosen, new_tokens=3, device=cpu, rounds=3)
    )
    assert order == [("plain", True), ("h2o", True)] + [("plain", False), ("h2o", False)] * 2
    assert [row.decode for row in rows] == [20.0, 5.0]
    assert gpu.row_line(rows[0], rows[0]).split("|")[8].strip() == "10.0-30.0"


def test_batch_max_measures_each_setting_at_its_own_largest_batch(monkeypatch):
    monkeypatch.setattr(
        gpu, "fits", lambda model, tokenizer, setting, prompt, device: lambda b: b <= (3 if setting.plain else 12)
    )
    monkeypatch.setattr(gpu, "measure", fake_measure)
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=5000))
    rows = list(
        gpu.benchmark(
            model,
            None,
            lengths=[8],
            batches=["max"],
            settings=settings("plain", "h2o"),
            new_tokens=3,
            device=torch.device("cpu"),
        )
    )
    assert [(row.setting, row.batch) for row in rows] == [("plain", 3), ("h2o", 12)]


def fake_measure(model, tokenizer, setting, ids, new_tokens, device, decoding="evict", warm=True):
    """A row without a model run: plain 1 s to the first token and 10 tok/s, the others twice as slow."""
    slower = 1 if setting.plain else 2
    return gpu.Row(
        ids.shape[1], ids.shape[0], setting.name, setting.graphs, [1.0 * slower], [10.0 / slower], None, 2**30
    )


def test_the_cli_prints_and_writes_one_markdown_table_under_the_devices_name(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(gpu, "measure", fake_measure)
    out = tmp_path / "gpu" / "table.md"
    options = [
        "--lengths",
        "24",
        "--batch",
        "1",
        "2",
        "--policies",
        "h2o",
        "snapkv",
        "--rounds",
        "1",
        "--out",
        str(out),
    ]
    gpu.main([*CPU, *options])
    printed = capsys.readouterr().out
    assert out.read_text() == printed
    lines = printed.splitlines()
    assert lines[0].startswith("## CPU")
    table = [line for line in lines if line.startswith("|")]
    assert table[0] == "| " + " | ".join(gpu.COLUMNS) + " |"
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table[2:]]
    assert all(len(row) == len(gpu.COLUMNS) for row in [*rows, table[1].strip("|").split("|")])
    cached = [(s, g) for s in ("full", "h2o", "snapkv") for g in ("on", "off")]
    expected = [("plain", "-"), ("plain-nocudnn", "-"), *cached]
    assert [row[:4] for row in rows] == [["24", str(b), s, g] for b in (1, 2) for s, g in expected]
    assert rows[0][4:] == ["1.000", "1.00x", "10.0", "-", "1.00x", "-", "1.000"]
    assert rows[2][4:] == ["2.000", "2.00x", "5.0", "-", "2.00x", "-", "1.000"]


def test_a_setting_out_of_gpu_memory_is_a_row_that_says_so_and_the_rest_still_run(monkeypatch, capsys):
    def short_of_memory(model, tokenizer, setting, ids, new_tokens, device, decoding="evict", warm=True):
        if setting.name == "full":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return fake_measure(model, tokenizer, setting, ids, new_tokens, device)

    monkeypatch.setattr(gpu, "measure", short_of_memory)
    gpu.main([*CPU, "--lengths", "24", "--policies", "h2o", "--graphs", "off", "--rounds", "1"])
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 24 ")]
    assert [line.split("|")[3].strip() for line in table] == ["plain", "plain-nocudnn", "full", "h2o"]
    assert "out of GPU memory" in table[2] and table[3].split("|")[5].strip() == "2.000"


def test_a_setting_that_fails_is_a_row_naming_the_error_its_traceback_on_stderr_and_the_rest_still_run(
    monkeypatch, capsys
):
    def broken(model, tokenizer, setting, ids, new_tokens, device, decoding="evict", warm=True):
        if setting.name == "h2o":
            raise RuntimeError("triton compile error\nsecond line")
        return fake_measure(model, tokenizer, setting, ids, new_tokens, device)

    monkeypatch.setattr(gpu, "measure", broken)
    gpu.main([*CPU, "--lengths", "24", "--policies", "h2o", "snapkv", "--graphs", "off", "--rounds", "1"])
    captured = capsys.readouterr()
    table = [line for line in captured.out.splitlines() if line.startswith("| 24 ")]
    assert [line.split("|")[3].strip() for line in table] == ["plain", "plain-nocudnn", "full", "h2o", "snapkv"]
    assert table[3].split("|")[5].strip() == "failed: RuntimeError: triton compile error"
    assert table[4].split("|")[5].strip() == "2.000"
    assert "Traceback" in captured.err and "second line" in captured.err
