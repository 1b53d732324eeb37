"""Presets the spec imports as ``from dew import presets``: ``presets.Flow()()`` is the rectified-flow Process."""

from dew.flow.process import Flow, Process

__all__ = ["Flow", "Process"]
