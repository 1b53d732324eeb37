"""Data the trainer reads: Dataset, partitions, stream positions, chat roles and packing."""

from dew.data.dataset import Batch, Dataset, Partition, StreamPosition
from dew.data.packing import pack_documents

__all__ = ["Batch", "Dataset", "Partition", "StreamPosition", "pack_documents"]
