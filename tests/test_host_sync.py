"""A decode step never reads a tensor's value on the host: on a GPU each such read waits for the device. Counted with
a ``TorchFunctionMode`` over whole decode steps (the model's forward, the backend, the eviction) of every
registered policy, under both decoding rules."""

from __future__ import annotations

import pytest
import torch
from conftest import registered
from torch.overrides import TorchFunctionMode

from h2o_eval import EvictionCache, compress, load_model
from h2o_eval.policies import example_policy

# The calls that read a tensor's value on the host (a device synchronisation on CUDA).
READS = {
    "item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "argwhere", "unique",
    "unique_consecutive", "masked_select", "equal", "allclose", "cpu", "numpy",
}  # fmt: skip
STEPS = 4


def _is_mask(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(part, torch.Tensor) and part.dtype == torch.bool for part in parts)


class HostReads(TorchFunctionMode):
    """Counts the calls of :data:`READS`, boolean-mask indexing, one-argument ``where`` and ``repeat_interleave``
    with a tensor of repeats: each reads a value on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if (
            name in READS
            or (name in ("__getitem__", "__setitem__") and len(args) > 1 and _is_mask(args[1]))
            or (name == "where" and len(args) == 1 and not kwargs)
            or (name == "repeat_interleave" and len(args) > 1 and isinstance(args[1], torch.Tensor))
        ):
            self.calls.append(name)
        return func(*args, **kwargs)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama", device="cpu")


def decode_reads(model, tokenizer, cache, prompt: torch.Tensor, mask: torch.Tensor) -> list[str]:
    """The host reads of :data:`STEPS` decode steps after ``prompt`` (left-padded as ``mask`` says) went through
    ``cache`` and a policy's extra passes ran."""
    token = torch.randint(5, 400, (prompt.shape[0], 1))
    reads = HostReads()
    with torch.no_grad():
        model(prompt, attention_mask=mask, cache=cache, use_cache=True)
        compress(model, cache, tokenizer, prompt, mask, max_new_tokens=4)
        for _ in range(STEPS):
            mask = torch.cat([mask, mask.new_ones(prompt.shape[0], 1)], -1)
            with reads:
                model(token, attention_mask=mask, cache=cache, use_cache=True)
    return reads.calls


@pytest.mark.parametrize("decoding", ["evict", "grow"])
@pytest.mark.parametrize("name", registered("prefill"))
def test_a_decode_step_reads_no_tensor_on_the_host(tiny, name, decoding):
    model, tokenizer = tiny
    prompt = torch.randint(5, 400, (2, 40))
    mask = torch.ones_like(prompt)
    mask[0, :5] = 0
    cache = EvictionCache(model, example_policy(name, 0.25), protocol="prefill", kernels="torch", decoding=decoding)
    assert decode_reads(model, tokenizer, cache, prompt, mask) == []
