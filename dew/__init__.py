"""dew: post-training for language models in JAX.

The spec's entry points: ``from dew import Trainer, Dataset, models`` and the
objectives under :mod:`dew.objectives`; for rectified-flow image models
``Field``, ``InputSpec`` and ``presets.Flow``.

The names below load on first use (PEP 562), so ``import dew.data.chat`` in a
loader's worker process does not start JAX, Flax and Orbax, whose imports take
seconds.
"""

import importlib
import os

# transformers announces at import that PyTorch is absent, which reads as fatal; dew uses it for tokenizers and
# configs only, and never needs PyTorch.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

_HOMES = {
    "Dataset": "dew.data.dataset", "Partition": "dew.data.dataset", "Field": "dew.flow.inputs",
    "InputSpec": "dew.flow.inputs", "Rollout": "dew.trainer", "TrainState": "dew.trainer", "Trainer": "dew.trainer",
    "models": "dew.models", "presets": "dew.presets",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'dew' has no attribute {name!r}")
    module = importlib.import_module(_HOMES[name])
    value = module if module.__name__ == f"dew.{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
