"""Data: text in, batches out. Owns everything between a corpus on disk and the tensors of a micro-batch.

Two flows, which never run side by side:

    prepare/          offline: a corpus -> shards, tokenizer, manifest.json (`python -m trainer.prepare`)
    (the rest)        training: shards -> documents -> rows -> micro-batches, resumable, on any shape

Shared by both:

    tokenizer         the byte-level BPE and its special tokens (trained, saved, hashed, extended)
    shards            WebDataset shards and manifest.json (written by prepare, read here); PrepareError
    chat              the chat template, rendering, and the assistant-only targets

The training stream:

    sources           where training shards come from (data.path, data.urls: files, http(s), pipe:)
    feed              what a training run takes from this room (trainer.run imports no other module of it)
    reader            one slot's reader: shard cursor, shuffle buffer, resumable read position
    stream, loader    the rank x worker split of the shards, tokenization, DataLoader workers (workers.py)
    tars              a tar shard's samples in one pass over its bytes (webdataset's layout, bounded headers)
    packing           the online packer (and offline BFD), long-document policies
    pipeline          `RowSource`, the interface every row source implements; documents -> rows ->
                      micro-batches for each layout (`RowStream`), the prefetch thread
    mixture           data.sources: rows drawn from several row streams by weight, per-source passes
    deal              data.balance=rows: a step's rows dealt over the data ranks by modeled work (equal
                      compute)
    epochs            every rule of when an epoch ends, for readers, loaders, mixtures and the ranks
                      (lockstep)
    state             the stream's state as typed, versioned objects, and their checkpoint form
    reshape           a stream state written on W x K readers, dealt to W' x K' at a resume (a mixture's by
                      source)
    batch             `Document`, `Batch`: ids, positions, labels (-100 at boundaries), cu_seqlens
    config            the `data` and `packing` config sections

Document boundaries get their one canonical form here (batch.collate_rows); the model only reads it.
Must not import: the model, distributed, checkpoint, run or config modules (only trainer.errors above it).
"""
