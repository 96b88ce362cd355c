"""Sources: tokenized documents on disk and in memory, read by index (the formats cpdata reads and writes).

Below the nodes: each reader is a ``Sequence`` of ``{"input_ids": int64 [n], ...}`` with its lengths known up
front and a fingerprint, so planners work from lengths and resumes and plans refuse other data. Modules:
``protocol`` (what a source may offer), ``base`` (``TokenizedDataset``), ``files``, ``tokenstore`` (with
``tokenstore_writer``, ``chunksums``, ``manifest``), ``megatron`` (with ``megatron_writer``), ``hf``,
``concat``, ``open`` (``open_dataset``), ``fingerprint``, ``tokenizer`` (text to tokens), ``atomic``
(crash-safe directory writes).
"""

from cpdata.sources.atomic import atomic_directory
from cpdata.sources.base import TokenizedDataset
from cpdata.sources.concat import ConcatDataset
from cpdata.sources.files import JsonlDocuments, LengthsFile, NpyFolder
from cpdata.sources.hf import HFDocuments
from cpdata.sources.megatron import MegatronIndexed
from cpdata.sources.megatron_writer import write_megatron
from cpdata.sources.open import as_source, open_dataset
from cpdata.sources.tokenstore import TokenStore, write_token_store

__all__ = ["ConcatDataset", "HFDocuments", "JsonlDocuments", "LengthsFile", "MegatronIndexed", "NpyFolder", "TokenStore",
           "TokenizedDataset", "as_source", "atomic_directory", "open_dataset", "write_megatron", "write_token_store"]
