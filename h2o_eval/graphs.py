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
- a model with a dynamic rotary embedding, which reads the positions on the host
  (:func:`~h2o_eval.attention.host_bound_rotary`);
- a shared prompt pass, and a stack's first forward (its question), which lays its rows out
  (:class:`~h2o_eval.groups.StackedDecode`); a stack's decode steps are captured, and the stack its leaving rows
  leave behind captures anew;
- a step that asks for attentions or hidden states, or brings ``inputs_embeds``.

A replayed step skips what an eager step checks on the host side of the device: it never refuses a padding token
after the prompt (``generate`` never feeds one); a model whose every layer slides is checked before each replay
(:meth:`~h2o_eval.cache.EvictionCache.prepare_decode`).

Each cache holds its own :class:`DecodeGraphs`, and they hold no reference to it: a copy of a cache captures its own
steps, and a dropped cache is freed by reference counting. A capture that raises (out of memory, an operation the
capture refuses) restores the cache's host state, leaves its device state untouched (a CUDA capture runs nothing),
and that cache decodes eagerly from then on, with one warning.

:class:`RecordedGraph` replays the aten operations of the captured step on any device with a CUDA graph's
semantics (``graphs="emulate"``): the host's code is not run again, tensors made during the capture are reused, a
value read on the host during the capture is refused, and a tensor neither the cache nor the static inputs keep is
refused, as a CUDA graph would read it freed. The tests prove on a CPU that replayed steps equal eager ones.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten operations that read a value on the host: each one waits for the device, and none can be captured.
HOST_READS = ("_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select", "unique")


@runtime_checkable
class Capturable(Protocol):
    """What a cache offers the captured decode steps (:class:`~h2o_eval.cache.EvictionCache` is one):

    - ``capturable(batch)``: whether its next one-token step of ``batch`` sequences can be captured;
    - ``prepare_decode()``: the host's work before a step (its layouts' buffers wide enough, scores made ahead);
    - ``buffers()``: what a step reads and writes, by address: a graph captured for others does not fit;
    - ``tensors()``: every tensor a step may read without owning it;
    - ``advance()``: its host counts after a replayed step, as an eager step moves them;
    - ``host_state()``, ``restore_host_state(state)``: its host counts kept, and put back after a capture that
      raised."""

    def capturable(self, batch: int) -> bool: ...

    def prepare_decode(self) -> None: ...

    def buffers(self) -> tuple: ...

    def tensors(self) -> list[torch.Tensor]: ...

    def advance(self) -> None: ...

    def host_state(self) -> list[tuple[object, dict]]: ...

    def restore_host_state(self, state: list[tuple[object, dict]]) -> None: ...


def host_state(parts: list[object]) -> list[tuple[object, dict]]:
    """The host's state of a cache, as the attributes of ``parts`` (its sequences', layers' and layouts' counts), to
    put back after a capture that raised (:func:`restore_host_state`). Lists and dicts are copied, as a step may change
    them in place; tensors are the device's and left as they are."""
    own = (dict, list)
    return [
        (part, {name: copy.copy(v) if isinstance(v, own) else v for name, v in vars(part).items()}) for part in parts
    ]


def restore_host_state(state: list[tuple[object, dict]]) -> None:
    for part, saved in state:
        vars(part).clear()
        vars(part).update(saved)


class CudaGraph:
    """A ``torch.cuda.CUDAGraph``: :meth:`capture` records a step without running it, :meth:`replay` runs it. A capture
    that raises raises the step's own error (not ``capture_end``'s, which names no operation)."""

    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, step: Callable[[], Any], owned: Callable[[], list[torch.Tensor]]) -> Any:
        torch.cuda.synchronize()
        stream = torch.cuda.current_stream()
        raised: list[BaseException] = []

        def guarded() -> Any:
            try:
                return step()
            except BaseException as error:
                raised.append(error)
                raise

        try:
            with torch.cuda.graph(self.graph):
                return guarded()
        except Exception as ended:
            torch.cuda.set_stream(stream)  # capture_end raising leaves the capture's side stream current
            raise (raised[0] if raised else ended) from None

    def replay(self, owned: Callable[[], list[torch.Tensor]]) -> None:
        self.graph.replay()


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


@dataclasses.dataclass(frozen=True)
class _Owned:
    """A tensor the graph reads and does not own, by address: the ``storage`` of one of its owners (the static
    inputs, the cache's buffers, the model's weights), seen as ``dtype``, ``size``, ``stride`` and ``offset``."""

    storage: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def get(self, owners: dict[int, torch.Tensor], op: str) -> torch.Tensor:
        owner = owners.get(self.storage)
        if owner is None:
            raise RuntimeError(
                f"a replayed decode step reads memory its capture found elsewhere ({op}): the step was captured for "
                "other buffers (another cache's, or ones freed since)"
            )
        view = torch.empty(0, dtype=self.dtype, device=owner.device)
        return view.set_(owner.untyped_storage(), self.offset, self.size, self.stride)


class _Recorder(TorchDispatchMode):
    """Records the aten operations of a capture (views excepted) and keeps, before a mutable operation writes a
    tensor that existed before the capture, a copy of it (a failed capture leaves memory as it was, as CUDA's does)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []
        self.made: set[int] = set()  # the storages allocated during the capture (the graph's own pool)
        self.before: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.__name__.split(".")[0] in HOST_READS:
            raise RuntimeError(f"a captured decode step reads a tensor's value on the host ({func.__name__})")
        if func.is_view and func._schema.is_mutable:  # a replay would change the shape again
            raise RuntimeError(f"a captured decode step changes a tensor's shape in place ({func.__name__})")
        if func._schema.is_mutable:
            for tensor in _written(func, args, kwargs):
                if _storage(tensor) not in self.made and id(tensor) not in self.before:
                    self.before[id(tensor)] = (tensor, tensor.clone())
        out = func(*args, **kwargs)
        if not func.is_view or func.__name__.startswith("lift_fresh"):  # a constant made from host data is baked in
            for tensor in _flat(out):
                if not func._schema.is_mutable:
                    self.made.add(_storage(tensor))
        if not func.is_view:
            self.ops.append((func, args, kwargs, None if func._schema.is_mutable else out))
        return out

    def restore(self) -> None:
        """Undo the capture's writes: the copies taken last first, so that where two views of one storage were
        written, the copy taken before either write is the one left."""
        for tensor, saved in reversed(list(self.before.values())):
            tensor.copy_(saved)


def _flat(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [tensor for item in value for tensor in _flat(item)]
    return []


def _written(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors a mutable aten operation writes."""
    written = []
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        written += _flat(value)
    return written


def _map(value: Any, function: Callable[[Any], Any], kind: type) -> Any:
    """``value`` with ``function`` applied to every leaf of type ``kind`` (in tuples, lists and dicts)."""
    if isinstance(value, kind):
        return function(value)
    if isinstance(value, tuple | list):
        return type(value)(_map(item, function, kind) for item in value)
    if isinstance(value, dict):
        return {name: _map(item, function, kind) for name, item in value.items()}
    return value


def _copy_into(recorded: Any, result: Any) -> None:
    if isinstance(recorded, torch.Tensor):
        recorded.copy_(result)
    elif isinstance(recorded, tuple | list):
        for mine, theirs in zip(recorded, result, strict=True):
            _copy_into(mine, theirs)


class RecordedGraph:
    """A CUDA graph's semantics on any device (``graphs="emulate"``, and the tests): :meth:`capture` runs the step once
    (that run is the first replay) and records its aten operations; :meth:`replay` runs them again without the host's
    code, writing each result where the capture's went.

    As a CUDA graph holds addresses, not tensors, it holds only the tensors made during the capture (its pool); every
    other tensor a step reads must be owned by ``owned()`` (the static inputs, the cache's buffers, the model's
    weights), and is found there again at each replay by its address. So a step that reads a tensor nobody keeps
    (freed after the capture) is refused at the capture, and a replay whose owners no longer hold what was captured
    (another cache, a buffer replaced) is refused. A value read on the host during the capture is refused, and a
    capture that raises leaves every tensor it wrote as it was."""

    def __init__(self) -> None:
        self.ops: list = []
        self.ran = False

    def capture(self, step: Callable[[], Any], owned: Callable[[], list[torch.Tensor]]) -> Any:
        recorder = _Recorder()
        try:
            with recorder:
                output = step()
        except BaseException:
            recorder.restore()
            raise
        where = {_storage(tensor) for tensor in owned()}

        def held(tensor: torch.Tensor) -> Any:
            storage = _storage(tensor)
            if storage in recorder.made or not tensor.numel():
                return tensor
            if storage not in where:
                raise RuntimeError(
                    f"a captured decode step reads a tensor of shape {list(tensor.shape)} that neither the cache nor "
                    "the step's static inputs keep: a CUDA graph would read it after it is freed"
                )
            return _Owned(storage, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())

        try:
            self.ops = [
                (func, _map(args, held, torch.Tensor), _map(kwargs, held, torch.Tensor), out)
                for func, args, kwargs, out in recorder.ops
            ]
        except RuntimeError:
            recorder.restore()
            raise
        self.ran = True
        return output

    def replay(self, owned: Callable[[], list[torch.Tensor]]) -> None:
        if self.ran:  # the capture's own run
            self.ran = False
            return
        owners = {_storage(tensor): tensor for tensor in owned()}
        for func, args, kwargs, out in self.ops:
            name = func.__name__

            def get(value: _Owned, name: str = name) -> torch.Tensor:
                return value.get(owners, name)

            result = func(*_map(args, get, _Owned), **_map(kwargs, get, _Owned))
            if out is not None:
                _copy_into(out, result)


class DecodeGraphs:
    """The captured decode steps of one cache (see the module): one graph at a time, for its current buffers and
    batch. ``graph``: what captures (:class:`CudaGraph`, or :class:`RecordedGraph` with ``graphs="emulate"``). It
    holds no reference to its cache (the cache holds it): each step is handed the cache it runs on, and a copy of a
    cache gets graphs of its own (:meth:`fresh`). ``failed``: why a capture raised, after which the cache decodes
    eagerly."""

    def __init__(self, graph: Callable[[], Any] = CudaGraph) -> None:
        self.make_graph = graph
        self.key: tuple | None = None
        self.warmed: tuple | None = None
        self.graph: Any = None
        self.inputs: dict[str, torch.Tensor] = {}
        self.output: Any = None
        self.replays = 0
        self.failed: str | None = None

    def fresh(self) -> DecodeGraphs:
        """Graphs of the same kind for a copy of the cache: none captured yet, and none tried again where a capture
        of this cache raised (the model and policy are the copy's too)."""
        graphs = DecodeGraphs(self.make_graph)
        graphs.failed = self.failed
        return graphs

    def step(
        self, cache: Capturable, model: torch.nn.Module, forward: Callable[..., Any], kwargs: dict[str, Any]
    ) -> Any:
        """The forward ``kwargs`` ask for through ``cache``, replayed; None when it is no capturable decode step (it
        then runs as before)."""
        ids, position = kwargs.get("input_ids"), kwargs.get("position_ids")
        asks_more = any(kwargs.get(name) for name in ("output_attentions", "output_hidden_states", "labels"))
        if ids is None or position is None or ids.shape[1] != 1 or asks_more or kwargs.get("inputs_embeds") is not None:
            return None
        if self.failed is not None or not cache.capturable(ids.shape[0]):
            return None
        cache.prepare_decode()
        key = (tuple(ids.shape), tuple(position.shape), kwargs.get("logits_to_keep"), cache.buffers())

        def owned() -> list[torch.Tensor]:
            return [*self.inputs.values(), *cache.tensors(), *model.parameters(), *model.buffers()]

        if key != self.key:
            if key != self.warmed:  # the first step on these buffers runs eagerly: a warm-up
                self.warmed = key
                return None
            state = cache.host_state()
            try:
                output = self._capture(cache, forward, kwargs, ids, position, owned)
            except Exception as error:  # noqa: BLE001 - any failure to capture falls back to eager decoding
                cache.restore_host_state(state)
                self._fail(error)
                return None
            self.output, self.key = dataclasses.replace(output, cache=None), key  # a replay hands its cache back
        else:
            self.inputs["input_ids"].copy_(ids)
            self.inputs["position_ids"].copy_(position)
            cache.advance()
        self.graph.replay(owned)
        self.replays += 1
        return dataclasses.replace(self.output, logits=self.output.logits.clone(), cache=cache)

    def _capture(self, cache: Capturable, forward, kwargs: dict[str, Any], ids, position, owned) -> Any:
        """Capture one step's forward on static inputs (its host counts move on as the step's own); its output."""
        batch = ids.shape[0]
        # A 4-D mask is taken as it is: nothing is built from the step's lengths, which a replay would not update. A
        # decode step reads no mask (its own slots say what is held). It is a static input: the graph reads it.
        mask = torch.ones(batch, 1, 1, 1, dtype=torch.bool, device=ids.device)
        self.inputs = {"input_ids": ids.clone(), "position_ids": position.clone(), "attention_mask": mask}
        static = {name: value for name, value in kwargs.items() if name not in ("input_ids", "position_ids")}
        static.update(self.inputs, cache=cache, use_cache=True)
        static.pop("past_key_values", None)
        static.pop("cache_position", None)
        self.graph, self.key = self.make_graph(), None
        return self.graph.capture(lambda: forward(**static), owned)

    def _fail(self, error: Exception) -> None:
        self.graph, self.output, self.key, self.inputs = None, None, None, {}
        cause = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        self.failed = cause
        warnings.warn(
            f"decode steps run eagerly: capturing one as a CUDA graph raised {cause} (graphs=false skips the capture)",
            RuntimeWarning,
            stacklevel=4,
        )


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
            output = graphs.step(cache, model, original, kwargs)
            if output is not None:
                return output
        return original(*args, **kwargs)

    forward.graphed = True
    model.forward = forward
