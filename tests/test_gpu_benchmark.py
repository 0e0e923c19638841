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
        (["--policies", "nonsense"], r"unknown policy 'nonsense'"),
        (["--lengths", "4000"], r"--lengths 4000 .* 2048 positions: use shorter prompts"),
        (["--batch", "0"], r"--batch take integers >= 1"),
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


def test_every_setting_is_measured_and_holds_the_kv_it_should():
    """plain ``generate``, the full EvictionCache and H2O on a tiny model: every number measured; plain's
    DynamicCache holds every token but the last, the full cache at least as much, H2O at half the prompt about
    half as many."""
    model, tokenizer = load_model("tiny-llama", device="cpu")
    policies = {"h2o": make_policy("h2o", budget=0.5)}
    cpu = torch.device("cpu")
    rows = list(gpu.benchmark(model, tokenizer, lengths=[32], batches=[2], policies=policies, new_tokens=3, device=cpu))
    assert [(r.length, r.batch, r.setting) for r in rows] == [(32, 2, "plain"), (32, 2, "full"), (32, 2, "h2o")]
    assert all(r.ttft_s > 0 and r.decode_tokens_per_s > 0 and r.peak_bytes is None and not r.note for r in rows)
    config = model.config
    entry = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4  # float32 K and V
    plain, full, h2o = (r.kv_bytes for r in rows)
    assert plain == 2 * (32 + 3 - 1) * entry and full >= plain
    assert h2o <= 2 * (16 + 1) * entry


@pytest.mark.slow
def test_every_setting_at_every_length_and_batch_reads_the_same_prompt(monkeypatch):
    """A shorter or smaller setting reads the first tokens and rows of the one seeded prompt; plain comes first."""
    seen: dict[tuple[int, int, str], torch.Tensor] = {}

    def spy(model, tokenizer, setting, policy, ids, new_tokens, device):
        seen[ids.shape[1], ids.shape[0], setting] = ids.clone()
        return fake_measure(model, tokenizer, setting, policy, ids, new_tokens, device)

    monkeypatch.setattr(gpu, "measure", spy)
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=5000))
    policies = {"h2o": make_policy("h2o")}
    cpu = torch.device("cpu")
    rows = list(
        gpu.benchmark(model, None, lengths=[16, 32], batches=[1, 2], policies=policies, new_tokens=3, device=cpu)
    )
    assert [(r.length, r.batch, r.setting) for r in rows] == [
        (length, batch, setting) for length in (16, 32) for batch in (1, 2) for setting in ("plain", "full", "h2o")
    ]
    widest = seen[32, 2, "plain"]
    assert len({tuple(row) for row in widest.tolist()}) == 2  # two different prompts in a batch
    for (length, batch, _), ids in seen.items():
        assert torch.equal(ids, widest[:batch, :length])


def fake_measure(model, tokenizer, setting, policy, ids, new_tokens, device):
    """A row without a model run: plain 1 s to the first token and 10 tok/s, the others twice as slow."""
    slower = 1 if setting == "plain" else 2
    return gpu.Row(ids.shape[1], ids.shape[0], setting, 1.0 * slower, 10.0 / slower, None, 2**30)


def test_the_cli_prints_and_writes_one_markdown_table_under_the_devices_name(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(gpu, "measure", fake_measure)
    out = tmp_path / "gpu" / "table.md"
    options = ["--lengths", "24", "--batch", "1", "2", "--policies", "h2o", "snapkv", "--out", str(out)]
    gpu.main([*CPU, *options])
    printed = capsys.readouterr().out
    assert out.read_text() == printed
    lines = printed.splitlines()
    assert lines[0].startswith("## CPU")
    table = [line for line in lines if line.startswith("|")]
    assert table[0] == "| " + " | ".join(gpu.COLUMNS) + " |"
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table[2:]]
    assert all(len(row) == len(gpu.COLUMNS) for row in [*rows, table[1].strip("|").split("|")])
    assert [row[:3] for row in rows] == [["24", str(b), s] for b in (1, 2) for s in ("plain", "full", "h2o", "snapkv")]
    assert rows[0][3:] == ["1.000", "1.00x", "10.0", "1.00x", "-", "1.000"]
    assert rows[1][3:] == ["2.000", "2.00x", "5.0", "2.00x", "-", "1.000"]


def test_a_setting_out_of_gpu_memory_is_a_row_that_says_so_and_the_rest_still_run(monkeypatch, capsys):
    def short_of_memory(model, tokenizer, setting, policy, ids, new_tokens, device):
        if setting == "full":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return fake_measure(model, tokenizer, setting, policy, ids, new_tokens, device)

    monkeypatch.setattr(gpu, "measure", short_of_memory)
    gpu.main([*CPU, "--lengths", "24", "--policies", "h2o"])
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 24 ")]
    assert [line.split("|")[3].strip() for line in table] == ["plain", "full", "h2o"]
    assert "out of GPU memory" in table[1] and table[2].split("|")[4].strip() == "2.000"


def test_a_setting_that_fails_is_a_row_naming_the_error_its_traceback_on_stderr_and_the_rest_still_run(
    monkeypatch, capsys
):
    def broken(model, tokenizer, setting, policy, ids, new_tokens, device):
        if setting == "h2o":
            raise RuntimeError("triton compile error\nsecond line")
        return fake_measure(model, tokenizer, setting, policy, ids, new_tokens, device)

    monkeypatch.setattr(gpu, "measure", broken)
    gpu.main([*CPU, "--lengths", "24", "--policies", "h2o", "snapkv"])
    captured = capsys.readouterr()
    table = [line for line in captured.out.splitlines() if line.startswith("| 24 ")]
    assert [line.split("|")[3].strip() for line in table] == ["plain", "full", "h2o", "snapkv"]
    assert table[2].split("|")[4].strip() == "failed: RuntimeError: triton compile error"
    assert table[3].split("|")[4].strip() == "2.000"
    assert "Traceback" in captured.err and "second line" in captured.err
