"""Rectified-flow pieces below the objectives: the Process, the sampler and what a batch holds."""

from dew.flow.inputs import Field, InputSpec, PatchAutoencoder
from dew.flow.process import Flow, Process
from dew.flow.trajectory import FlowTrajectory, sample_trajectory

__all__ = ["Field", "Flow", "FlowTrajectory", "InputSpec", "PatchAutoencoder", "Process", "sample_trajectory"]
