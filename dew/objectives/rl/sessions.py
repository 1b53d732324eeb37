"""The spec's ``dew.objectives.rl.sessions``: engine-sourced records, ``pack`` and ``session_metrics``.

The records are a layer of their own, above the objectives that train on packed rows and
below the collection that produces them, so they live in :mod:`dew.records`
(``session_records``, ``session_packing``, ``session_metrics``); placing them under the objectives would have
the collection layer import from inside an objectives package. This module is the spec's
name for them.
"""

from dew.losses.advantages import ESTIMATORS
from dew.records.session_metrics import session_metrics
from dew.records.session_packing import chain_lengths, pack, rows_needed, session_advantages
from dew.records.session_records import TRUNCATIONS, Call, Session, SessionSource, Status, Task, training_reward

__all__ = [
    "Call", "ESTIMATORS", "Session", "SessionSource", "Status", "TRUNCATIONS", "Task", "chain_lengths", "pack",
    "rows_needed", "session_advantages", "session_metrics", "training_reward",
]
