"""Key re-rotation (kvpress's ``KeyRerotationPress``): after a prompt's compression, the keys a KV head kept are
rotated from their tokens' positions to contiguous ones, as if the evicted tokens had never been there.

kvpress re-rotates a head's n kept keys to positions 0..n-1 and its pipeline then feeds the question from position n
(``cache.get_seq_length()``). Here the kept keys go to the n positions that end at the prompt's last token,
last - n + 1..last, and later tokens keep their own positions from last + 1: every query then sees every kept key
at the same distance as in kvpress (rotary attention reads only the distance), the cache's positions and masks
stay the tokens', and heads that keep different numbers of tokens (Ada-KV) each end next to the next token.

A key is re-rotated by the angle between its two positions (kvpress's ``rerotate_keys``): cos and sin of
(new - old) times the rotary's inverse frequencies, in float32, cast to the keys' dtype. The frequencies come from
the model's config (``rope_parameters``: its type, ``rope_theta`` and scaling) by transformers' own functions;
a rotary whose frequencies depend on the length (``dynamic``, ``longrope``), one that turns only part of each head
(``partial_rotary_factor``) or a model without rotary embedding is refused.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import rotate_half

from h2o_eval.decode import Slots
from h2o_eval.errors import ConfigError

# Rotary types whose frequencies are fixed (not a function of the sequence's length), so a key can be turned later.
FIXED = ("default", "linear", "llama3", "yarn")


def inverse_frequencies(model: torch.nn.Module, owner: str) -> list[torch.Tensor]:
    """Per layer, the inverse frequencies [D / 2] (float32, on the model's device) of ``model``'s rotary embedding,
    from its config; ``owner`` names the policy in a refusal."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    rotary = getattr(model.get_decoder(), "rotary_emb", None)
    parameters = getattr(config, "rope_parameters", None)
    if rotary is None or not parameters:
        raise ConfigError(
            f"{owner} re-rotates the kept keys, and {config.model_type} has no rotary position embedding to turn: "
            "use a rotary model (Llama, Mistral, Qwen, Gemma 3) or a policy without key re-rotation"
        )
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    nested = all(isinstance(value, dict) for value in parameters.values())
    found = []
    for kind in kinds:
        params = parameters[kind] if nested else parameters
        rope_type = params.get("rope_type", "default")
        if rope_type not in FIXED:
            raise ConfigError(
                f"{owner} re-rotates the kept keys, and {config.model_type}'s rotary type {rope_type!r} has no fixed "
                f"frequencies to turn them by (dynamic and longrope change with the length): use a model whose rotary "
                f"is one of {', '.join(FIXED)}"
            )
        if params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) != 1.0:
            raise ConfigError(
                f"{owner} re-rotates whole keys, and {config.model_type} rotates only part of each head: use a model "
                "whose rotary turns the whole head (Llama, Mistral, Qwen, Gemma 3)"
            )
        compute = rotary.compute_default_rope_parameters if rope_type == "default" else ROPE_INIT_FUNCTIONS[rope_type]
        with torch.device(next(model.parameters()).device):  # transformers makes them on the default device
            inv_freq, _ = compute(config, layer_type=kind) if nested else compute(config)
        found.append(inv_freq.float())
    return found


def rerotate(
    keys: torch.Tensor, held: torch.Tensor, position: torch.Tensor, last: torch.Tensor, inv_freq: torch.Tensor
) -> torch.Tensor:
    """``keys`` [B, Hkv, S, D] (rotated at their tokens' ``position`` [B, Hkv, S]) with each (sequence, KV head)'s
    n ``held`` keys turned to the positions ``last`` - n + 1..``last`` in the order of their tokens (``last`` [B]:
    each sequence's last prompt position); keys not held are returned as they are."""
    slots = held.shape[-1]
    order = torch.argsort(position.masked_fill(~held, torch.iinfo(position.dtype).max), dim=-1, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(slots, device=held.device).expand_as(order))
    target = last.view(-1, 1, 1) - held.sum(-1, keepdim=True) + 1 + rank
    delta = torch.where(held, target - position, 0)
    freqs = delta.unsqueeze(-1).float() * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos().to(keys.dtype), angles.sin().to(keys.dtype)
    return keys * cos + rotate_half(keys) * sin


def rerotated(slots: Slots, last: torch.Tensor, frequencies: tuple[torch.Tensor, ...] | None, layer: int) -> Slots:
    """A compressed prompt's ``slots`` (dense) with their held keys re-rotated (:func:`rerotate`) by ``layer``'s
    ``frequencies`` (None: a policy that does not re-rotate, the slots as they are); ``last`` [B, 1, 1]."""
    if frequencies is None:
        return slots
    keys = rerotate(slots.keys, slots.held, slots.position, last.view(-1), frequencies[layer])
    return dataclasses.replace(slots, keys=keys)
