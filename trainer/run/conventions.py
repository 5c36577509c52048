"""What a run records beside its weights (conventions.json in every checkpoint and export): enough for a later
run, or another library, to rebuild the same inputs and the same objective.

The checkpoint store decides where the file goes (trainer.checkpoint.store); this module decides what it says.
"""

from __future__ import annotations

import dataclasses

from trainer.checkpoint.store import TOKENIZER_DIR
from trainer.config import RunConfig
from trainer.data.feed import VAL_SPLIT, DataSource, FramedTokenizer

LOSS_DEFINITIONS = {
    "global_tokens": "sum of token cross-entropies over valid targets / valid targets of the whole optimizer "
    "step (all micro-batches, all ranks)",
    "document_mean": "mean token cross-entropy of each document (a chunk of a split document counts as one), "
    "averaged over the documents of the whole optimizer step (all ranks)",
    "micro_batch_mean": "mean token cross-entropy of each micro-batch, averaged over the micro-batches of "
    "all ranks",
    "row_mean": "mean token cross-entropy of each row, averaged over the rows of the whole optimizer step "
    "(all ranks)",
}


LOSS_ON_TARGETS = {
    "all": "every token but the first of each document or chunk",
    "assistant": "the tokens of assistant turns only (content and the closing <|im_end|>; a token counts if "
    "its characters overlap one); role headers, system/user turns, the newline after <|im_end|> and EOS are "
    "inputs (trainer.data.chat)",
}



def conventions(cfg: RunConfig, data: DataSource, engine_name: str, world_size: int,
                dtype: str = "fp32") -> dict:
    """What a later run needs to rebuild the same inputs and objective (saved beside the weights).

    dtype: train.dtype as the run resolved it ('fp32' or 'bf16', see trainer.config.resolve_dtype).
    """
    return {
        "layout": cfg.packing.layout,
        "packing": {
            "algorithm": "online: the oldest buffered document opens each row, best fit (or an exact pair of "
                         "short documents) fills it, from a bounded buffer; offline best-fit-decreasing for "
                         "the epoch's leftovers (trainer.data.packing.OnlinePacker)",
            "buffer_size": cfg.packing.buffer_size,
            "row_length": cfg.train.seq_len,
            "long_docs": cfg.packing.long_docs,
            "unpacked_pad_to": cfg.packing.pad_to,
            "same_documents_in_every_layout": True,
        },
        "positions": {"scheme": cfg.model.pos_emb, "reset_at_document_start": cfg.packing.reset_positions},
        "attention": {"backend": cfg.attention.backend, "isolate_documents": cfg.attention.isolate_documents},
        "labels": {
            "shifted": "inside the loss (labels are stored unshifted)",
            "ignore_index": -100,
            "ignored": ["first position of every document or chunk", "padding", "loss-masked tokens"],
            "eos": "appended to every document and kept as a target"
            + (" (with loss_on=assistant: an input only)" if cfg.data.loss_on == "assistant" else ""),
            "loss_on": cfg.data.loss_on,
            "targets": LOSS_ON_TARGETS[cfg.data.loss_on],
        },
        "loss": {
            "normalization": cfg.loss.normalization,
            "definition": LOSS_DEFINITIONS[cfg.loss.normalization],
        },
        "eval": {
            "split": VAL_SPLIT, "order": "manifest shards permuted with seed 0, file order, no shuffle",
            "docs": cfg.train.eval_docs, "long_docs": "split", "layout": cfg.train.eval_layout,
            "val_loss": "sum of token cross-entropies / eval targets (all ranks)",
        },
        "tokenizer": {"files": f"{TOKENIZER_DIR}/", "sha256": data.tokenizer_hash,
                      "vocab_size": data.vocab_size,
                      # how each document is framed: [BOS] text EOS where add_bos, the pad and where it came
                      # from
                      "framing": dataclasses.asdict(FramedTokenizer.load(data.tokenizer_dir).ids)},
        "engine": engine_name,
        "dtype": dtype,
        "world_size": world_size,
        "tokens_per_step": cfg.train.tokens_per_step,
    }
