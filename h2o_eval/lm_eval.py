"""lm-eval's own CLI, with the eviction backend as the model ``h2o_eval``.

    python -m h2o_eval.lm_eval --model h2o_eval \
        --model_args pretrained=smollm2-135m,policy=h2o,budget=0.2,protocol=simulate --tasks copa,piqa

Every lm-eval option works as with ``lm_eval`` itself (``--include_path``, ``--num_fewshot``, ``--limit``,
``--output_path``, ``--log_samples`` ...). The model class is :class:`h2o_eval.eviction_lm.EvictionLM`, the one
``python -m h2o_eval`` scores with. lm-eval 0.4 discovers models only in its own registry (no plugin entry
point), so importing this module registers ``h2o_eval`` there; a plain ``lm_eval --model h2o_eval`` cannot see it.
"""

from __future__ import annotations

from lm_eval.__main__ import cli_evaluate
from lm_eval.api.registry import register_model

from h2o_eval.errors import ConfigError
from h2o_eval.eviction_lm import MODEL_NAME, EvictionLM
from h2o_eval.run import fail

register_model(MODEL_NAME)(EvictionLM)


def main() -> None:
    try:
        cli_evaluate()
    except ConfigError as error:
        fail(error)


if __name__ == "__main__":
    main()
