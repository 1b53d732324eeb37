"""The spec's ``dew.objectives.rl.verl``: sessions as verl AgentLoopOutput rows and back.

The conversion works on the engine-sourced records, so it lives with them
(:mod:`dew.records.verl_rows`); this module is the path the spec imports it from. Dew never
imports verl or torch: rows are plain ``model_dump()`` mappings.
"""

from dew.records.verl_rows import VerlTrajectory, from_verl, to_verl

__all__ = ["VerlTrajectory", "from_verl", "to_verl"]
