"""dew: post-training for language models in JAX.

The spec's entry points: ``from dew import Trainer, Dataset, models`` and the
objectives under :mod:`dew.objectives`.
"""

from dew import models
from dew.data import Dataset, Partition
from dew.trainer import Rollout, Trainer, TrainState

__all__ = ["Dataset", "Partition", "Rollout", "TrainState", "Trainer", "models"]
