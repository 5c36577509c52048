"""The offline flow: a corpus on disk in, WebDataset shards, a tokenizer and manifest.json out
(`python -m trainer.prepare`, a thin command over `dataset.prepare`). Nothing here runs beside training.

    dataset           `prepare` (plan, tokenizer, units in parallel processes, the merge) and `merge` (parts)
    plan, units       the input cut into units of a few MB (keys from positions) and one unit's work
    corpus            sources of text (stdlib demo, text files, JSONL, parquet, HF datasets),
                      error policy, keys
    formats           record files as corpora ship them (JSONL, .gz, .zst, parquet, HF datasets), cut in spans
    conversations     chat records checked before rendering, and the demo chat set
    assemble          the output directory: staging, the merge of units and parts, the swap into place

What both flows share stays in trainer.data: the shard format and manifest (shards), the tokenizer, the chat
template (chat), the config sections.
Must not import: the training stream (stream, loader, reader, pipeline, mixture, epochs, state, reshape,
feed), nor anything above trainer.data. The training stream must not import this package.
"""
