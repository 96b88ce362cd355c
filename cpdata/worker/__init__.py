"""The worker's batch machinery: the pure numpy and host-torch functions a dataloader worker runs
between packing and handing a batch over (the nodes of :mod:`cpdata.nodes` wrap them); nothing here
touches ``torch.distributed`` or the environment.

Modules, in pipeline order: ``keys``, ``targets`` (labels conventions), ``token_buffer``, ``plan``
(documents, pieces, plans), ``stream_slots``, ``stream`` (buffers and target counts too),
``collate`` (and ``CollatedPack``), ``shard_block`` (a block's layout math, plan digests), ``buffer_spans``
and ``batch`` (``ShardedBatch``)."""

__all__: list[str] = []
