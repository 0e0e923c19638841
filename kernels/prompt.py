"""The prompt pass of a rule that votes: the model's attention output and each key's summed votes.

:func:`prompt_votes` is the one entry point. On the GPU (``triton``) it takes the output and each row's
log-sum-exp from torch's own fused attention where it can (:func:`fused_attention_lse`), so the output costs what
the model's attention costs, then makes one more pass over the keys for the column sums
(:func:`~h2o_eval.kernels.column_scores.column_sums`) that visits only the rows that vote. On the CPU path it is
:func:`~h2o_eval.kernels.reference.column_scores_reference`, the definition, which computes each logit once for
both. Imports no Triton unless asked for the Triton path.
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend

from h2o_eval.kernels.reference import column_scores_reference, first_voters

FLASH_DTYPES = (torch.float16, torch.bfloat16)


def _flash_takes(*tensors: torch.Tensor) -> bool:
    """Whether torch's CUDA flash-attention kernel takes these query, key, value: fp16/bf16, a head dim that is a
    multiple of 8 up to 256, the last dim contiguous, an sm80+ device (the checks torch's SDPA makes before
    choosing it)."""
    query = tensors[0]
    dim = query.shape[-1]
    return (
        all(t.dtype == query.dtype and t.stride(-1) == 1 for t in tensors)
        and query.dtype in FLASH_DTYPES
        and dim % 8 == 0
        and dim <= 256
        and torch.cuda.get_device_capability(query.device) >= (8, 0)
    )


def fused_attention_lse(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Causal attention over an unpadded prompt and each row's log-sum-exp from torch's own fused kernel, or None
    where none takes these inputs.

    query [B, Hq, T, D]; key, value [B, Hkv, T, D] (query head h*G+g reads KV head h). Returns the output
    [B, Hq, T, D] in the query's dtype and lse [B, Hq, T] float32: the natural log of the sum of exp(scaled
    logits) over the keys each row sees. On CUDA: the kernel SDPA itself picks for these inputs
    (``torch._fused_sdp_choice``), so that the prompt costs what the model's own attention costs: cuDNN's
    (``aten._scaled_dot_product_cudnn_attention``, asked for its log-sum-exp; SDPA's first choice on sm90+, about
    1.7x flash-attention 2's speed at 32k on an H200) or flash-attention 2's
    (``aten._scaled_dot_product_flash_attention``). Both take K/V unexpanded (query head h*G+g reads KV head h),
    as SDPA hands them for ``enable_gqa=True``, so they are not expanded here either, which would copy G times
    the keys and values of a long prompt. On the CPU (Triton's interpreter):
    ``aten._scaled_dot_product_flash_attention_for_cpu``, which takes Hkv < Hq as they are too. None of them takes
    a padding mask here, so padded prompts do not come here; float32 or odd head dims on CUDA get None.
    """
    if query.device.type == "cpu":
        output, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, True, scale=scaling
        )
        return output, lse
    if query.device.type != "cuda" or not _flash_takes(query, key, value):
        return None
    choice = torch._fused_sdp_choice(query, key, value, None, 0.0, True, scale=scaling, enable_gqa=True)
    if choice == int(SDPBackend.CUDNN_ATTENTION):
        cudnn = torch.ops.aten._scaled_dot_product_cudnn_attention
        fused = cudnn(query, key, value, None, True, 0.0, True, scale=scaling)
    else:
        fused = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, True, scale=scaling)
    lse = fused[1]
    return fused[0], lse.reshape(*lse.shape[:2], -1)[..., : query.shape[2]]


def prompt_votes(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor,
    weights: torch.Tensor,
    scaling: float,
    output: bool = True,
    triton: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Causal attention over a prompt and each key's weighted column sum of its probabilities, with
    :func:`~h2o_eval.kernels.reference.column_scores_reference`'s contract: query [B, Hq, T, D]; key, value
    [B, Hkv, T, D]; valid [B, T] bool (False: padding); weights [B, T] float, one per row. Returns (the output
    [B, Hq, T, D] in the query's dtype, or None without ``output``; columns [B, Hkv, T] float32), columns[b, h, j]
    = sum_i weights[b, i] sum_g P[b, h*G+g, i, j].

    With ``triton``, the output and the rows' log-sum-exp come from :func:`fused_attention_lse` for an unpadded
    prompt, else from :func:`~h2o_eval.kernels.column_scores.attention_lse` (padding, inputs no fused kernel
    takes, and without ``output`` for the voting rows alone), then the column sums from
    :func:`~h2o_eval.kernels.column_scores.column_sums`. Rows before each sequence's first nonzero weight cost
    nothing in the column pass, nor in the log-sum-exp pass without ``output``. Without ``triton``:
    :func:`~h2o_eval.kernels.reference.column_scores_reference`.
    """
    if not triton:
        return column_scores_reference(query, key, value, valid, weights, scaling, output=output)
    from h2o_eval.kernels.column_scores import attention_lse, column_sums

    fused = fused_attention_lse(query, key, value, scaling) if output and bool(valid.all()) else None
    if fused is None:
        fused = attention_lse(query, key, value, valid, scaling, None if output else first_voters(weights))
    attention, lse = fused
    return attention, column_sums(query, key, valid, lse, weights, scaling)
