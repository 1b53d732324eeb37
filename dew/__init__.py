"""dew: post-training for language models in JAX.

The spec's entry points: ``from dew import Trainer, Dataset, models`` and the
objectives under :mod:`dew.objectives`; for rectified-flow image models
``Field``, ``InputSpec`` and ``presets.Flow``.
"""

from dew import models, presets
from dew.data import Dataset, Partition
from dew.flow.inputs import Field, InputSpec
from dew.trainer import Rollout, Trainer, TrainState

__all__ = ["Dataset", "Field", "InputSpec", "Partition", "Rollout", "TrainState", "Trainer", "models", "presets"]
