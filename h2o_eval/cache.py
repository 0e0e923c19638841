"""The ``decode`` protocol: :class:`EvictionCache`, a transformers ``Cache`` that physically holds at most C
entries per (sequence, layer, KV head), evicting through the same mechanism as :func:`h2o_eval.patch`."""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from h2o_eval.backend import (
    BACKEND,
    check_kv_heads,
    check_supported,
    check_window,
    kernel_function,
    key_validity,
    kv_head_count,
    layer_windows,
    plain_attention,
    plan_tensors,
    routing,
    starting_scores,
)
from h2o_eval.errors import ConfigError
from h2o_eval.eviction import Chunk, attend_held, claim_slot
from h2o_eval.policies import UNBOUNDED, Policy, check_kernels, check_protocol


def _decode_triton(kernels: str, model: torch.nn.Module) -> bool:
    """Whether decode steps run the Triton kernel: ``auto`` on CUDA, ``triton`` where Triton can run."""
    device = next(model.parameters()).device
    check_kernels(kernels, device.type)
    return kernels == "triton" or (kernels == "auto" and device.type == "cuda")


class EvictionLayer(CacheLayerMixin):
    """One layer's bounded cache: keys/values [B, Hkv, S, D] with each slot's held flag, position and score, and
    the layer's capacity per (sequence, KV head). Heads may hold different numbers of tokens (Ada-KV); a slot
    that is not held is free and the next arriving token takes it. A sliding layer of a model that also has
    global layers (``window``) holds its last ``window`` - 1 tokens between forwards, as transformers' own
    sliding cache does, and the policy does not touch it (see ``h2o_eval.backend.layer_windows``).

    ``is_sliding`` stays False even there: transformers then builds masks over every position seen, so the last
    columns of any layer's mask are the slots it holds."""

    is_sliding = False
    is_croppable = False

    @property
    def owner(self) -> EvictionCache:
        return self._owner()

    def __init__(self, owner: EvictionCache, layer_idx: int, window: int | None = None) -> None:
        super().__init__()
        # A weak link: cache -> layers -> cache would be a cycle that only the garbage collector frees, so a
        # loop making one cache per batch would hold every finished cache until a full collection.
        self._owner, self.layer_idx, self.window = weakref.ref(owner), layer_idx, window
        self.seen = 0
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.slot: torch.Tensor | None = None  # [B, Hkv] slot the single arriving token took (decode steps)
        self.plan: dict[str, torch.Tensor] | None = None
        self.moved = False  # whether slots stopped being the model's own positions (an eviction or compaction)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, kv_heads, _, _ = key_states.shape
        self.keys = key_states[:, :, :0]
        self.values = value_states[:, :, :0]
        self.held = torch.zeros(batch, kv_heads, 0, dtype=torch.bool, device=key_states.device)
        self.position = torch.zeros(batch, kv_heads, 0, dtype=torch.int64, device=key_states.device)
        self.scores = torch.zeros(batch, kv_heads, 0, dtype=torch.float32, device=key_states.device)
        self.real_seen = torch.zeros(batch, dtype=torch.int64, device=key_states.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.pending is not None:
            raise RuntimeError(
                f"layer {self.layer_idx} did not run through the h2o_eval attention backend: refusing to evict blind"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        routing.pending = self
        if (
            self.window is None
            and key_states.shape[2] == 1
            and self.seen > 0
            and (slot := self._claim(key_states)) is not None
        ):
            # One token per sequence into a warm cache: evict (or take a free slot) right here, in place.
            index = slot.view(*slot.shape, 1, 1).expand(-1, -1, 1, key_states.shape[-1])
            self.keys.scatter_(2, index, key_states)
            self.values.scatter_(2, index, value_states)
            self.slot, self.pending = slot, (self.keys, self.values)
            return self.keys, self.values
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        self.pending = (keys, values)
        return keys, values

    def _claim(self, key_states: torch.Tensor) -> torch.Tensor | None:
        plan = self.plan
        now = self.real_seen
        slot = claim_slot(self.held, self.position, self.scores, now, plan["capacity"], plan["recent"], plan["sinks"])
        if slot is None:
            return None
        self.moved = True
        at = slot.unsqueeze(-1)
        new_position = now.view(-1, 1, 1).expand(-1, key_states.shape[1], 1)
        self.held.scatter_(-1, at, True)
        self.position.scatter_(-1, at, new_position)
        fresh = starting_scores(self.owner.policy, key_states, new_position, self.layer_idx)
        self.scores.scatter_(-1, at, fresh)
        return slot

    def attend(self, module, query, key, value, attention_mask, scaling, output: bool = True) -> torch.Tensor | None:
        """This layer's attention for the chunk ``update`` just took, and the cache state after it. Without
        ``output`` (a :class:`SharedPrompt` pass, which computes the prompt's attention once) only the state is
        computed, and None returned."""
        self.pending, routing.pending = None, None
        owner = self.owner
        batch, kv_heads, n = key.shape[0], key.shape[1], query.shape[2]
        check_kv_heads(module, query, key, owner.kv_heads)
        arriving = key_validity(attention_mask, batch, n, key.device)
        check_window(owner.window, int((self.real_seen + arriving.sum(-1)).max()))
        if self.window is not None:
            return self._attend_window(module, query, key, value, attention_mask, scaling, arriving, output)
        if self.slot is not None:
            if not bool(arriving.all()):
                raise RuntimeError(
                    "a padding token after the prompt: EvictionCache takes padding only in the first chunk"
                )
            self.slot = None
            rule = owner.policy.rule
            output = attend_held(query, key, value, self.held, self.scores, rule, scaling, owner.triton)
            self._advance(arriving)
            return output
        first = self.seen == 0
        if first:
            self.plan = owner.layer_plan(self.layer_idx, arriving, kv_heads)
        new_position = (self.real_seen.unsqueeze(-1) + arriving.cumsum(-1) - 1).clamp(min=0)
        new_position = new_position.unsqueeze(1).expand(batch, kv_heads, n)
        entered = torch.cat([self.held, arriving.unsqueeze(1).expand(batch, kv_heads, n)], dim=-1)
        if not self.moved and bool((self.plan["capacity"] >= UNBOUNDED).all()):  # nothing will ever be evicted
            self.keys, self.values, self.held = key, value, entered
            self.position = torch.cat([self.position, new_position], dim=-1)
            self._advance(arriving)
            return plain_attention(module, query, key, value, attention_mask, scaling) if output else None
        position = torch.cat([self.position, new_position], dim=-1).contiguous()
        fresh = starting_scores(owner.policy, key[:, :, -n:], new_position, self.layer_idx)
        chunk = Chunk(
            held=torch.cat([self.held, torch.zeros(batch, kv_heads, n, dtype=torch.bool, device=key.device)], -1),
            arriving=arriving,
            position=position,
            scores=torch.cat([self.scores, fresh], dim=-1),
            capacity=self.plan["capacity"],
            recent=self.plan["recent"],
            sinks=self.plan["sinks"],
            prefill=torch.full((batch,), n if first and owner.protocol != "simulate" else 0, device=key.device),
            rule=owner.policy.rule,
            scaling=scaling,
            output=output,
        )
        result = owner.kernel(query, key, value, chunk)
        self.plan["capacity"] = result.capacity
        if result.kept is not None:
            owner.record_prompt(self.layer_idx, result.kept)
        held, scores = result.held, result.scores
        if torch.equal(held, entered):  # nothing left: the slots stay as they are
            self.keys, self.values = key, value
        else:  # keep only held slots (per head, padded to the fullest head)
            self.moved = True
            size = int(held.sum(-1).max())
            order = torch.argsort((~held).to(torch.int8), dim=-1, stable=True)[..., :size]
            self.keys = key.gather(2, order.unsqueeze(-1).expand(-1, -1, -1, key.shape[-1]))
            self.values = value.gather(2, order.unsqueeze(-1).expand(-1, -1, -1, value.shape[-1]))
            held, position, scores = held.gather(-1, order), position.gather(-1, order), scores.gather(-1, order)
        self.held, self.position, self.scores = held, position, scores
        self._advance(arriving)
        return result.output

    def _attend_window(self, module, query, key, value, attention_mask, scaling, arriving, output=True):
        """The model's own sliding-window attention over the slots held (the mask's last columns), then keep the
        last ``window`` - 1 slots."""
        if self.seen > 0 and not bool(arriving.all()):
            raise RuntimeError("a padding token after the prompt: EvictionCache takes padding only in the first chunk")
        mask = None if attention_mask is None else attention_mask[..., -key.shape[2] :]
        result = plain_attention(module, query, key, value, mask, scaling) if output else None
        keep = min(key.shape[2], self.window - 1)
        self.keys, self.values = key[:, :, key.shape[2] - keep :], value[:, :, value.shape[2] - keep :]
        self.held = torch.ones(key.shape[0], key.shape[1], keep, dtype=torch.bool, device=key.device)
        self._advance(arriving)
        return result

    def _advance(self, arriving: torch.Tensor) -> None:
        self.seen += arriving.shape[1]
        self.real_seen = self.real_seen + arriving.sum(-1)
        self.owner.peak_entries = max(self.owner.peak_entries, int(self.held.sum(-1).max()))

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.is_initialized = False
        self.seen, self.pending, self.slot, self.plan, self.moved = 0, None, None, None, False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("EvictionCache does not support beam search")


class EvictionCache(Cache):
    """A transformers ``Cache`` that holds at most C entries per (sequence, layer, KV head).

    ``protocol="simulate"``: the first chunk is fed under per-step eviction from an empty cache;
    ``protocol="prefill"`` or ``"context"``: the first chunk (the prompt, or the context before the question)
    attends in full and is then compressed to the budget. Every later chunk (one token per step when generating)
    arrives under the policy's decoding rule: one eviction per arriving token once the cache is full, or none
    for policies that grow after their prompt. A fraction budget applies to ``length`` (int or one per
    sequence) or, if None, to the first chunk's length. Creating the cache routes the model's attention through
    the h2o_eval backend; forwards without an EvictionCache and outside :func:`patch` keep plain SDPA attention.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        policy: Policy,
        *,
        protocol: str = "simulate",
        length: int | list[int] | None = None,
        kernels: str = "auto",
    ) -> None:
        check_supported(model)
        check_protocol(policy, protocol, kernels)
        if not policy.has_cache:
            raise ConfigError(
                f"policy {policy.name!r} exists only as a simulation of scoring, with no cache: use patch(..., "
                "'simulate')"
            )
        self.policy, self.protocol, self.length = policy, protocol, length
        self.kernel = kernel_function(kernels, next(model.parameters()).device)
        self.triton = _decode_triton(kernels, model)
        self.peak_entries = 0
        windows, self.window = layer_windows(model)
        self.num_layers = len(windows)
        self.kv_heads = kv_head_count(model)
        self.lengths: list[int] | None = None
        self.prompt_held: dict[int, torch.Tensor] = {}  # layer -> [B, Hkv] tokens kept when the prompt compressed
        super().__init__(layers=[EvictionLayer(self, i, window) for i, window in enumerate(windows)])
        model.set_attn_implementation(BACKEND)

    def layer_plan(self, layer: int, arriving: torch.Tensor, kv_heads: int) -> dict[str, torch.Tensor]:
        """The layer's capacity per (sequence, KV head), recent window and sinks, fixed on the first chunk."""
        if self.lengths is None:
            batch = arriving.shape[0]
            if self.length is not None:
                self.lengths = [self.length] * batch if isinstance(self.length, int) else list(self.length)
            elif arriving.shape[1] == 1 and self.policy.capacity(1) != self.policy.capacity(1 << 20):
                raise ConfigError(
                    "a fraction budget needs a length: give EvictionCache(..., length=N) or a token budget"
                )
            else:
                self.lengths = arriving.sum(-1).tolist()
        return plan_tensors(self.policy, self.lengths, layer, self.num_layers, kv_heads, arriving.device)

    def record_prompt(self, layer: int, held: torch.Tensor) -> None:
        self.prompt_held[layer] = held

    def capacity(self) -> torch.Tensor:
        """[B] realised C per sequence: tokens kept after the prompt (or the plan's C), mean over layers and KV
        heads, at most the length the budget applies to; a sliding layer that keeps its own window counts as
        min(length, window)."""
        per_layer = []
        for layer in self.layers:
            if layer.window is not None and self.lengths is not None:
                per_layer.append(torch.tensor(self.lengths, device=layer.keys.device).clamp(max=layer.window).float())
                continue
            if layer.plan is None:
                continue
            planned = layer.plan["capacity"].clamp(max=UNBOUNDED - 1)
            kept = self.prompt_held.get(layer.layer_idx, planned)
            lengths = torch.tensor(self.lengths, device=kept.device).view(-1, 1)
            per_layer.append(torch.minimum(torch.minimum(kept, planned), lengths).float().mean(-1))
        return torch.stack(per_layer).mean(0)

    def kv_bytes(self) -> int:
        """Bytes of keys and values the cache holds now."""
        return sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in self.layers if layer.is_initialized)


class SharedPromptLayer(CacheLayerMixin):
    """One layer of :class:`SharedPrompt`: the chunk goes to every cache's layer, attention is computed once."""

    is_sliding = False
    is_croppable = False

    def __init__(self, layers: list[EvictionLayer]) -> None:
        super().__init__()
        self.layers = layers
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if any(layer.seen for layer in self.layers):
            raise RuntimeError("SharedPrompt feeds the first chunk of empty caches only")
        self.pending = [layer.update(key_states, value_states) for layer in self.layers][0]
        routing.pending = self
        return self.pending

    def attend(self, module, query, key, value, attention_mask, scaling) -> torch.Tensor:
        self.pending, routing.pending = None, None
        for layer in self.layers:
            layer.attend(module, query, key, value, attention_mask, scaling, output=False)
        return plain_attention(module, query, key, value, attention_mask, scaling)

    def get_seq_length(self) -> int:
        return self.layers[0].get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.layers[0].get_mask_sizes(query_length)

    def get_max_length(self) -> int:
        return -1


class SharedPrompt(Cache):
    """Feeds one first chunk (a prompt, or a context) to several empty :class:`EvictionCache` s of one model at
    once. In the ``prefill`` and ``context`` protocols that chunk attends in full whatever the policy, so its
    attention is computed once (as the full cache computes it), while each cache scores and compresses it by its
    own policy; the caches then go on alone. Decoding through a ``SharedPrompt`` is refused: the policies part
    there."""

    def __init__(self, caches: list[EvictionCache]) -> None:
        if any(cache.protocol == "simulate" for cache in caches):
            raise ConfigError("simulate scores every row under eviction: its first chunk cannot be shared")
        super().__init__(
            layers=[SharedPromptLayer(list(layers)) for layers in zip(*(c.layers for c in caches), strict=True)]
        )
