"""Decode steps captured as CUDA graphs and replayed: the model's forward and the cache's step together.

At batch 1 a decode step is host-bound: each of the forward's kernels is launched from Python, and the launches take
longer than the work. A decode step over an :class:`~h2o_eval.cache.EvictionCache` writes into static buffers
(:mod:`h2o_eval.decode`), reads no value on the host and takes its shapes from its buffers, so it can be captured
once as a CUDA graph and replayed for every later step whose buffers are the same: under an evicting policy every
step (the held slots have a fixed count), under a growing one (``decoding=grow``, the full cache) every step until
the buffers need a new bucket, when one more capture is made.

:func:`install` wraps the model's ``forward`` (once): a call that brings an EvictionCache whose ``graphs`` is set
(:class:`DecodeGraphs`) and feeds one token per sequence goes to it; any other call runs as before. For each set of
buffers, the first step runs eagerly (it warms up the kernels and allocates what the step keeps), the second is
captured and replayed, and every later one copies its inputs into the graph's and replays it; the host's own
counts of the cache (:meth:`~h2o_eval.layer.EvictionLayer.advance`) move on as an eager step would move them.

What is not captured, and runs eagerly:

- a chunk of more than one token (a prompt, a question), and extra passes (KVzip's): they compress, which reads the
  device on the host;
- a model with sliding-window layers that keep their own window (Gemma 3): such a layer keeps its last tokens by
  concatenation, a new tensor each step;
- a stacked decode (several caches' views as one batch) and a shared prompt pass;
- a step that asks for attentions or hidden states, or brings ``inputs_embeds``.

A replayed step skips what an eager step checks on the host side of the device: it never refuses a padding token
after the prompt (``generate`` never feeds one).

:class:`RecordedGraph` replays the aten operations of the captured step on any device, with a CUDA graph's
semantics (the host's code is not run again, tensors made during the capture are reused, a value read on the host
during the capture is refused): the tests prove on a CPU that replayed steps equal eager ones.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten operations that read a value on the host: each one waits for the device, and none can be captured.
HOST_READS = ("_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select", "unique")


class CudaGraph:
    """A ``torch.cuda.CUDAGraph``: :meth:`capture` records a step without running it, :meth:`replay` runs it."""

    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, step: Callable[[], Any]) -> Any:
        torch.cuda.synchronize()
        with torch.cuda.graph(self.graph):
            return step()

    def replay(self) -> None:
        self.graph.replay()


class _Recorder(TorchDispatchMode):
    def __init__(self, ops: list) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.__name__.split(".")[0] in HOST_READS:
            raise RuntimeError(f"a captured decode step reads a tensor's value on the host ({func.__name__})")
        out = func(*args, **kwargs)
        if not func.is_view:
            self.ops.append((func, args, kwargs, out))
        return out


def _copy_into(recorded: Any, result: Any) -> None:
    if isinstance(recorded, torch.Tensor):
        recorded.copy_(result)
    elif isinstance(recorded, tuple | list):
        for mine, theirs in zip(recorded, result, strict=True):
            _copy_into(mine, theirs)


class RecordedGraph:
    """A CUDA graph's semantics on any device, for tests: :meth:`capture` runs the step once (that run is the first
    replay) and records its aten operations; :meth:`replay` runs them again on the tensors they were recorded with,
    without the host's code, writing each result where the capture's went. A value read on the host during the
    capture is refused, as a CUDA graph refuses it."""

    def __init__(self) -> None:
        self.ops: list = []
        self.ran = False

    def capture(self, step: Callable[[], Any]) -> Any:
        self.ops = []
        with _Recorder(self.ops):
            output = step()
        self.ran = True
        return output

    def replay(self) -> None:
        if self.ran:  # the capture's own run
            self.ran = False
            return
        for func, args, kwargs, out in self.ops:
            result = func(*args, **kwargs)
            if not func._schema.is_mutable:
                _copy_into(out, result)


class DecodeGraphs:
    """The captured decode steps of one cache (see the module): one graph at a time, for its current buffers and
    batch. ``graph``: what captures (:class:`CudaGraph`; :class:`RecordedGraph` in tests)."""

    def __init__(self, cache: Any, graph: Callable[[], Any] = CudaGraph) -> None:
        self.cache, self.make_graph = cache, graph
        self.key: tuple | None = None
        self.warmed: tuple | None = None
        self.graph: Any = None
        self.inputs: dict[str, torch.Tensor] = {}
        self.output: Any = None
        self.replays = 0

    def step(self, forward: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
        """The forward ``kwargs`` ask for, replayed; None when it is no capturable decode step (it then runs as
        before)."""
        cache = self.cache
        ids, position = kwargs.get("input_ids"), kwargs.get("position_ids")
        asks_more = any(kwargs.get(name) for name in ("output_attentions", "output_hidden_states", "labels"))
        if ids is None or position is None or ids.shape[1] != 1 or asks_more or kwargs.get("inputs_embeds") is not None:
            return None
        if not cache.capturable(ids.shape[0]):
            return None
        cache.prepare_decode()
        key = (tuple(ids.shape), tuple(position.shape), kwargs.get("logits_to_keep"), cache.buffers())
        if key != self.key:
            if key != self.warmed:  # the first step on these buffers runs eagerly: a warm-up
                self.warmed = key
                return None
            self._capture(forward, kwargs, ids, position, key)
        else:
            self.inputs["input_ids"].copy_(ids)
            self.inputs["position_ids"].copy_(position)
            cache.advance()
        self.graph.replay()
        self.replays += 1
        return dataclasses.replace(self.output, logits=self.output.logits.clone())

    def _capture(self, forward, kwargs: dict[str, Any], ids, position, key: tuple) -> None:
        """Capture one step's forward on static inputs (its host counts move on as the step's own)."""
        batch = ids.shape[0]
        self.inputs = {"input_ids": ids.clone(), "position_ids": position.clone()}
        # A 4-D mask is taken as it is: nothing is built from the step's lengths, which a replay would not update. A
        # decode step reads no mask (its own slots say what is held).
        mask = torch.ones(batch, 1, 1, 1, dtype=torch.bool, device=ids.device)
        static = {name: value for name, value in kwargs.items() if name not in ("input_ids", "position_ids")}
        static.update(self.inputs, attention_mask=mask, cache=self.cache, use_cache=True)
        static.pop("past_key_values", None)
        static.pop("cache_position", None)
        self.graph = self.make_graph()
        self.output = self.graph.capture(lambda: forward(**static))
        self.key = key


def install(model: torch.nn.Module) -> None:
    """Wrap ``model.forward`` once, so that a decode step over a cache with graphs is captured and replayed
    (:class:`DecodeGraphs`); every other call runs the model's own forward."""
    if getattr(model.forward, "graphed", False):
        return
    original = model.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        graphs = getattr(cache, "graphs", None)
        if graphs is not None and not args:
            output = graphs.step(original, kwargs)
            if output is not None:
                return output
        return original(*args, **kwargs)

    forward.graphed = True
    model.forward = forward
