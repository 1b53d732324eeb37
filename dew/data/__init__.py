"""Data the trainer reads: Dataset, partitions, stream positions, chat roles, packing and file loaders."""

from dew.data.chat import ChatMessages, HFOptions, Role
from dew.data.dataset import Batch, Dataset, Partition, StreamPosition
from dew.data.loading import Loading, RecordError
from dew.data.document_packing import pack_documents
from dew.data.preference_pairs import PreferencePairs
from dew.data.prompts import Prompts

__all__ = [
    "Batch", "ChatMessages", "Dataset", "HFOptions", "Loading", "Partition", "PreferencePairs", "Prompts",
    "RecordError", "Role", "StreamPosition", "pack_documents",
]
