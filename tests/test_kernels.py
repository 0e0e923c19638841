"""Triton kernels against their PyTorch references, under TRITON_INTERPRET=1 (set in conftest)."""

from __future__ import annotations

import itertools

import pytest
import torch
from h2o_eval.kernels.decode_attention import decode_attention
from h2o_eval.kernels.reference import decode_attention_reference

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize(
    ("batch", "heads", "slots", "dim", "dtype"),
    list(itertools.product([1, 2], [(4, 4), (6, 2), (8, 2)], [1, 17, 64, 65], [64], [torch.float32]))
    + [(2, (6, 2), 130, 128, torch.float32), (1, (8, 2), 65, 64, torch.float16), (1, (6, 2), 33, 64, torch.bfloat16)],
)
def test_decode_attention_kernel_equals_reference(batch, heads, slots, dim, dtype):
    """Reference: decode_attention_reference (PyTorch); implementation: the Triton kernel, 64-slot blocks, so
    1, 17 and 65 slots cross or miss block boundaries."""
    q_heads, kv_heads = heads
    gen = torch.Generator().manual_seed(slots * 7 + dim)
    query = torch.randn(batch, q_heads, dim, generator=gen).to(dtype)
    keys = torch.randn(batch, kv_heads, slots, dim, generator=gen).to(dtype)
    values = torch.randn(batch, kv_heads, slots, dim, generator=gen).to(dtype)
    held = torch.rand(batch, kv_heads, slots, generator=gen) > 0.3
    held[..., 0] = True  # every KV head holds at least one slot
    base = torch.rand(batch, kv_heads, slots, generator=gen)
    scores_ref, scores = base.clone(), base.clone()
    expected = decode_attention_reference(query, keys, values, held, scores_ref, dim**-0.5)
    got = decode_attention(query, keys, values, held, scores, dim**-0.5)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(scores, scores_ref, rtol=tol, atol=tol)
    assert torch.equal(scores[~held], base[~held])


@pytest.mark.parametrize("name", ["h2o", "tova"])
def test_eviction_cache_decodes_the_same_with_the_triton_kernel(name):
    """Reference: EvictionCache with kernels=torch; implementation: kernels=triton (the decode kernel in every
    evicting step), fed token by token with dozens of evictions."""
    from h2o_eval import EvictionCache, load_model, make_policy

    model, _ = load_model("tiny-llama", device="cpu")
    ids = torch.randint(100, 40000, (2, 24), generator=torch.Generator().manual_seed(0))
    logits = {}
    for kernels in ("torch", "triton"):
        cache = EvictionCache(model, make_policy(name, budget=6), kernels=kernels)
        with torch.no_grad():
            logits[kernels] = torch.cat(
                [model(ids[:, i : i + 1], past_key_values=cache, use_cache=True).logits for i in range(24)], dim=1
            )
    assert (logits["torch"] - logits["triton"]).abs().max() <= 1e-4


def test_forcing_triton_where_it_cannot_run_is_refused(monkeypatch):
    from h2o_eval import EvictionCache, load_model, make_policy, patch
    from h2o_eval.errors import ConfigError

    model, _ = load_model("tiny-llama", device="cpu")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ConfigError, match="kernels=triton needs a CUDA device, not cpu"):
        EvictionCache(model, make_policy("h2o", budget=8), kernels="triton")
    with (
        pytest.raises(ConfigError, match="kernels=triton so far covers EvictionCache's decode steps"),
        patch(model, make_policy("h2o"), kernels="triton"),
    ):
        pass
