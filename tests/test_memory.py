"""What eviction holds in memory against plain ``generate`` (:mod:`h2o_eval.benchmarks.memory`: the peak of live
tensor bytes during a generation, as a GPU's allocator counts them), on a random Llama whose cache is most of what
a prompt pass holds."""

from __future__ import annotations

import pytest
import torch

from h2o_eval.benchmarks.memory import LiveBytes, measure, random_llama


@pytest.fixture(scope="module")
def peaks():
    torch.manual_seed(0)
    model = random_llama(layers=8, hidden=128, heads=4, kv_heads=4)
    prompt = torch.randint(5, 30000, (1, 1024))
    return {setting: measure(model, setting, prompt, new_tokens=4) for setting in ("plain", "full", "h2o:0.2")}


def test_live_bytes_count_what_is_alive_and_its_peak():
    with LiveBytes() as live:
        kept = torch.ones(1024, dtype=torch.float32)
        torch.ones(2048, dtype=torch.float32)  # freed at once
    assert (live.now, live.peak) == (4096, 4096 + 8192)
    del kept


def test_the_full_cache_holds_at_most_5_percent_more_than_plain_generate(peaks):
    assert peaks["full"].kv == peaks["plain"].kv
    assert peaks["full"].peak <= 1.05 * peaks["plain"].peak


def test_h2o_at_a_fifth_of_the_cache_holds_less_than_plain_generate_by_most_of_the_kv(peaks):
    saved = peaks["plain"].kv - peaks["h2o:0.2"].kv
    assert peaks["h2o:0.2"].kv <= 0.21 * peaks["plain"].kv
    assert peaks["h2o:0.2"].peak <= peaks["plain"].peak - 0.5 * saved
