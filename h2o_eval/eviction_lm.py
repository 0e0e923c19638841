"""lm-eval's ``HFLM`` under KV eviction: the model class of the ``lm_eval`` runner and of ``python -m
h2o_eval.lm_eval``.

Log-likelihood requests are scored in one forward under :func:`h2o_eval.patch` (the session's protocol);
``generate_until`` requests go through ``model.generate`` with an :class:`~h2o_eval.cache.EvictionCache`, on the
one generation path every runner uses (:mod:`h2o_eval.generation`).
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from importlib import resources
from typing import Any

import torch
import yaml
from lm_eval.models.huggingface import HFLM

from h2o_eval import generation
from h2o_eval.backend import Session, patch
from h2o_eval.errors import ConfigError
from h2o_eval.policies import Policy

MODEL_NAME = "h2o_eval"


def question_start(lm_task: Any, doc: dict[str, Any], prompt: str) -> int:
    """Where the scored document's own text starts in a request's prompt, after the demonstrations: the prompt
    ends with the task's ``doc_to_text`` of the document (or, for tasks with several inputs such as Winogrande,
    with one of its inputs)."""
    texts = lm_task.doc_to_choice(doc) if lm_task.multiple_input else [lm_task.doc_to_text(doc)]
    ends = [len(prompt) - len(text) for text in texts if isinstance(text, str) and text and prompt.endswith(text)]
    if not ends:
        raise ConfigError(
            f"protocol=context cannot find where task {lm_task.config.task}'s question starts in its prompt: "
            "use protocol=prefill"
        )
    return min(ends)


def common_prefix(a: list[int], b: list[int]) -> int:
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


class EvictionLM(HFLM):
    """HFLM telling the backend each padded row's real length and context length, and generating through an
    :class:`~h2o_eval.cache.EvictionCache`.

    HFLM right-pads a batch and calls the model without a mask. Per-sequence budgets need each row's length
    (simulate: the request, context + continuation minus its last token) and where its context ends: for
    ``prefill`` the whole prompt, for ``context`` the demonstrations before the scored document's own text
    (found with ``task``, the lm-eval task being scored). Both are looked up from the requests HFLM is about to
    score. Generation under ``context`` runs one request at a time (its context ends in its own column).
    """

    def __init__(
        self, *, session: Session, kernels: str = "auto", graphs: bool | str = True, task: Any = None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.session, self.kernels, self.graphs, self.task = session, kernels, graphs, task
        self.generation: generation.GenerationLog | None = None  # what generate_until requests generated

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict[str, Any] | None = None) -> EvictionLM:
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(
        cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None
    ) -> EvictionLM:
        """lm-eval's ``--model_args`` (and ``--batch_size``, ``--device``): see :meth:`from_settings`."""
        extra = {key: value for key, value in (additional_config or {}).items() if value is not None}
        return cls.from_settings(**{**arg_dict, **extra})

    @classmethod
    def from_settings(
        cls,
        pretrained: str | None = None,
        policy: str = "h2o",
        budget: float | int = 0.2,
        protocol: str = "simulate",
        kernels: str = "auto",
        graphs: bool | str = True,
        device: str = "auto",
        dtype: str = "auto",
        batch_size: int | str = 1,
        max_batch_size: int | None = None,
        **params: Any,
    ) -> EvictionLM:
        """The model ``pretrained`` (registry name, HF id or local path) patched with ``policy`` at ``budget``
        for as long as the returned object lives; ``params`` override the policy's own settings
        (``conf/policy/<policy>.yaml``), e.g. ``heavy_ratio``; ``graphs=false`` decodes ``generate_until``
        requests eagerly, ``graphs=emulate`` replays them with a CUDA graph's rules on any device
        (:mod:`h2o_eval.graphs`). Every setting is checked before the weights load
        (:func:`check_settings`)."""
        from h2o_eval.models import load_model

        built, device = check_settings(
            pretrained, policy, budget, protocol, kernels, graphs, device, dtype, batch_size, **params
        )
        model, tokenizer = load_model(pretrained, device=device, dtype=dtype)
        stack = ExitStack()
        session = stack.enter_context(patch(model, built, protocol, kernels))
        lm = cls(
            pretrained=model, tokenizer=tokenizer, batch_size=int(batch_size), session=session, kernels=kernels,
            graphs=graphs,
        )  # fmt: skip
        lm.patched = stack  # the model stays patched while the LM lives
        return lm

    def record_fields(self) -> dict[str, Any]:
        """The record's ``capacity`` (and, for ``generate_until`` requests, ``generation``): the generated
        requests' caches, else the log-likelihood forwards' (the same statistics either way)."""
        if self.generation is not None:
            return self.generation.fields()
        return {"capacity": self.session.capacity_stats()}

    def loglikelihood(self, requests, disable_tqdm=False):
        if self.session.protocol == "context":
            self.question_starts = {
                request.args[0]: question_start(self.task, request.doc, request.args[0]) for request in requests
            }
        return super().loglikelihood(requests, disable_tqdm)

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, override_bs=None):
        self.context_lengths: dict[tuple[int, ...], int] = {}
        for key, context, continuation in requests:  # key: (prompt, continuation), or (None,) for rolling windows
            fed = (context + continuation)[-(self.max_length + 1) :][:-1]
            if self.session.protocol == "context":
                demonstrations = self.tok_encode(key[0][: self.question_starts[key[0]]])
                cut = len(context) + len(continuation) - 1 - len(fed)  # tokens lost to left truncation
                self.context_lengths[tuple(fed)] = max(0, common_prefix(demonstrations, context) - cut)
            else:
                self.context_lengths[tuple(fed)] = max(1, len(fed) - len(continuation) + 1)
        return super()._loglikelihood_tokens(requests, disable_tqdm, override_bs)

    def _model_call(self, inps, attn_mask=None, labels=None):
        lengths, contexts = zip(*(self._lookup(row) for row in inps.tolist()), strict=True)
        mask = torch.arange(inps.shape[1], device=inps.device) < torch.tensor(lengths, device=inps.device)[:, None]
        self.session.context_lengths = list(contexts)
        with (
            torch.no_grad(),
            torch.autocast(
                device_type=self.device.type,
                dtype=self.mixed_precision_dtype,
                enabled=self.mixed_precision_dtype is not None,
            ),
        ):
            return self.model(inps, attention_mask=mask.long()).logits

    def _lookup(self, row: list[int]) -> tuple[int, int]:
        for length in range(len(row), 0, -1):
            if (context := self.context_lengths.get(tuple(row[:length]))) is not None:
                return length, context
            if row[length - 1] != 0:  # lm-eval pads with 0: a real token ends the search
                break
        raise RuntimeError("a batch row matches no request being scored: lm-eval's batching changed")

    def generate_until(self, requests, disable_tqdm=False):
        if self.session.protocol == "context":
            self.context_widths: dict[tuple[int, ...], int] = {}
            for request in requests:
                prompt = request.args[0]
                ids = self.tok_encode(prompt)
                demonstrations = self.tok_encode(prompt[: question_start(self.task, request.doc, prompt)])
                self.context_widths[tuple(ids)] = common_prefix(demonstrations, ids)
        return super().generate_until(requests, disable_tqdm)

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        mask = generation_kwargs.pop("attention_mask")
        if self.session.protocol != "context":
            return self._generate(context, mask, None, max_length, stop, generation_kwargs)
        rows = []
        for ids, row_mask in zip(context, mask, strict=True):
            own = ids[row_mask.bool()].unsqueeze(0)
            width = self.context_widths.get(tuple(own[0].tolist()))
            if width is None:
                raise RuntimeError("a prompt was truncated to the model's length: use protocol=prefill")
            padding = context.shape[1] - own.shape[1]
            out = self._generate(own, torch.ones_like(own), width, max_length - padding, stop, dict(generation_kwargs))
            rows.append(torch.cat([ids, out[0, own.shape[1] :]]))
        pad = self.tokenizer.pad_token_id
        return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=pad)

    def _generate(self, ids, mask, width, max_length, stop, generation_kwargs):
        """HFLM's ``model.generate`` call through a fresh :class:`EvictionCache`, on the one generation path
        (:func:`h2o_eval.generation.complete`: the context columns fed and compressed first, a policy's extra
        passes before its compression), decoding with HFLM's own call so its stop sequences apply."""
        from h2o_eval.cache import EvictionCache

        batch = generation.Batch(ids, mask, width)
        began = time.perf_counter()
        session = self.session
        cache = EvictionCache(
            self.model, session.policy, protocol=session.protocol, kernels=self.kernels, decoding=session.decoding,
            graphs=self.graphs, interval=session.interval,
        )  # fmt: skip
        if cache.policy.needs_answer:
            raise ConfigError(
                f"policy {cache.policy.name!r} needs each request's full-cache answer, which lm-eval's "
                "generate_until requests do not give it: use it on a long-context or summarisation task"
            )

        def generate(ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, **settings: Any) -> torch.Tensor:
            return HFLM._model_generate(
                self, ids, ids.shape[1] + max_new_tokens, stop, attention_mask=mask, cache=cache, **settings
            )

        sequences = generation.complete(
            self.model, cache, batch, self.tokenizer, generate=generate, max_new_tokens=max_length - ids.shape[1],
            **generation_kwargs,
        )  # fmt: skip
        if self.generation is None:
            self.generation = generation.GenerationLog(max_new_tokens=max_length - ids.shape[1])
        self.generation.add(batch, sequences, cache, time.perf_counter() - began, generation.end_tokens(self.tokenizer))
        return sequences


def check_settings(
    pretrained: str | None = None,
    policy: str = "h2o",
    budget: float | int = 0.2,
    protocol: str = "simulate",
    kernels: str = "auto",
    graphs: bool | str = True,
    device: str = "auto",
    dtype: str = "auto",
    batch_size: int | str = 1,
    max_batch_size: int | None = None,
    **params: Any,
) -> tuple[Policy, str]:
    """The settings of :meth:`EvictionLM.from_settings` (lm-eval's ``--model_args``, ``--batch_size`` and
    ``--device``), each refused in one line naming the fix before any weights load: the policy, its parameters and
    budget, the protocol and kernels, the batch size, device and dtype, and the model's availability. Returns the
    policy and the device to load on: a CUDA device falls back to the CPU without CUDA, as lm-eval's own ``hf``
    model does (lm-eval asks for ``cuda:0`` unless told otherwise). ``max_batch_size`` (lm-eval's, for automatic
    batch sizes, which eviction refuses) is taken and ignored."""
    from h2o_eval.models import check_available, resolve_device, resolve_dtype
    from h2o_eval.policies import check_kernels, check_protocol, make_policy

    if pretrained is None:
        raise ConfigError("--model_args names no model: add pretrained=NAME (a registry name, a hub id or a path)")
    if protocol == "context":
        raise ConfigError(
            "protocol=context needs the task's prompts to find each question: use python -m h2o_eval "
            "task=lm_eval task.name=... protocol=context"
        )
    built = make_policy(policy, budget, **(policy_settings(policy) | params))
    check_protocol(built, protocol, kernels)
    if graphs not in (True, False, "emulate"):
        raise ConfigError(f"graphs={graphs!r}: use true, false or emulate")
    if not str(batch_size).isdigit() or int(batch_size) < 1:
        raise ConfigError(f"--batch_size {batch_size}: use a number >= 1 (eviction needs each batch's layout)")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        device = "cpu"
    target = resolve_device(device)
    resolve_dtype(dtype, target)
    check_kernels(kernels, target.type)
    check_available(pretrained)
    return built, device


def policy_settings(name: str) -> dict[str, Any]:
    """A policy's own settings as the CLI's ``policy=<name>`` gives them (``conf/policy/<name>.yaml``)."""
    source = resources.files("h2o_eval.conf") / "policy" / f"{name}.yaml"
    if not source.is_file():
        return {}
    return {key: value for key, value in yaml.safe_load(source.read_text()).items() if key != "name"}
