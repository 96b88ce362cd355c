"""The worker's batch machinery: records, labels, token buffers, streams, collate and the batch.

Role: the pure (numpy, host torch) functions a dataloader worker runs between
packing and handing a batch over; the torchdata nodes in :mod:`cpdata.nodes`
wrap them. Nothing here touches ``torch.distributed`` or reads the environment.

Modules, in pipeline order: ``keys`` (batch keys and their pad values),
``targets`` (the labels/mask conventions, declared by the caller), ``token_buffer``
(the per-token arrays of many documents concatenated once), ``plan`` (documents,
pieces, pack plans), ``stream_slots`` (a batch's slots, checked, and their
metadata), ``stream_buffer`` (the buffer a batch's ranks gather from),
``stream`` (both together, for a block of batches), ``stream_targets`` (a
batch's target count), ``collate`` (full pack or one rank's tokens),
``collated`` (``CollatedPack``, the record between ``Collate`` and
``ShardForRank``), ``shard_block`` (the layout math of a block of batches),
``buffer_spans`` (the byte spans of a batch's one storage) and ``batch``
(``ShardedBatch``, what a rank receives).
"""

__all__: list[str] = []
