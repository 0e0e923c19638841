"""The board's floor (``benchmarks.floor``): its arithmetic counted from a config, checked against torch's own count
of a real forward pass."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM

from h2o_eval.benchmarks.floor import Shapes, document_flops, kernel_seconds
from h2o_eval.models import load_config


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
def test_a_tokens_linear_logits_and_attention_flops_are_what_torch_counts_of_a_forward_pass(name):
    config = load_config(name)
    shapes = Shapes.of(config)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    tokens = 12  # eager attention multiplies every (query, key) pair, masked or not, in every layer
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.arange(1, tokens + 1).unsqueeze(0), logits_to_keep=tokens)
    every_pair = len(shapes.windows) * tokens * tokens * shapes.pair()
    assert counter.get_total_flops() == tokens * (shapes.linear() + shapes.logits()) + every_pair


@pytest.mark.parametrize("window", [None, 1, 3, 7, 50])
def test_a_causal_pass_counts_the_pairs_its_mask_lets_through(window):
    tokens = 20
    shapes = Shapes(8, 8, 2, 1, 4, 10, (None, window))
    allowed = torch.ones(tokens, tokens, dtype=torch.bool).tril()
    windowed = allowed if window is None else allowed & ~allowed.tril(-window)
    assert shapes.causal_pairs(tokens) == allowed.sum() + windowed.sum()
    assert shapes.all_pairs(5, tokens) == 5 * tokens + 5 * (tokens if window is None else min(tokens, window))


def record(policy, kept, question=10, answer=5.0, context=100):
    return {
        "policy": policy,
        "capacity": {"length_mean": context, "layer_capacity_mean": [kept, kept]},
        "generation": {"prompt_tokens_mean": context + question, "generated_tokens_mean": answer},
    }


def test_a_document_pays_its_prompt_and_kvzips_rehearsal_once_and_each_cells_question_and_answer():
    shapes = Shapes(8, 16, 2, 1, 4, 32, (None, None))
    alone = document_flops(shapes, [record("full", 100)])
    cells = [record("full", 100), record("kvzip", 50), record("kvzip", 25, answer=1.0)]
    together = document_flops(shapes, cells)
    assert alone["scoring"] == 0
    assert together["prompt"] == alone["prompt"] == 100 * shapes.linear() + 2 * 100 * 101 / 2 * shapes.pair()
    assert together["scoring"] == 100 * shapes.linear() + 2 * 100 * 100 * shapes.pair()
    assert together["question"] == sum(10 * (shapes.linear() + 2 * kept * shapes.pair()) for kept in (100, 50, 25))
    # the first answer token comes from the question's pass: its logits only
    decoded = sum(4 * (shapes.linear() + 2 * kept * shapes.pair()) for kept in (100, 50))
    assert together["decoding"] == decoded + 11 * shapes.logits()


def test_decoding_in_its_kernels_is_each_cells_products_at_their_rates_and_its_reads_at_the_attentions():
    shapes = Shapes(8, 16, 2, 1, 4, 32, (None, None))
    cells = [record("full", 100, answer=5.0), record("knorm", 30, answer=1.0), record("snapkv", 50, answer=3.0)]
    # per decoded token: the layers' products 2 * (8 * 8 * 2 + 2 * 8 * 4 + 3 * 8 * 16) * 2 layers = 2304 FLOPs at
    # 2304 FLOP/s (1 s), and its cell's kept keys and values, 2 * 4 elements of 4 bytes per token in each of 2 layers,
    # at 32 bytes/s (2 s a kept token); per answer token its logits, 2 * 8 * 32 FLOPs at 512 FLOP/s (1 s)
    expected = sum(answer * 1 + (answer - 1) * (1 + 2 * kept) for kept, answer in ((100, 5), (30, 1), (50, 3)))
    assert kernel_seconds(shapes, cells, mlp=2304.0, logits=512.0, attention=32.0) == expected
