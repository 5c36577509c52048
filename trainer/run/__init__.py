"""The run: what `python -m trainer.train` does once the config is typed and the process group exists.

    loop        `Trainer`: builds the parts from a RunConfig and runs the loop (cadence of log, eval,
                checkpoint; resume; preemption)
    step        one optimizer step: the loss weights of the normalization, reduced once across ranks, then
                forward/backward over the micro-batches and the update
    evaluate    the held-out eval (fixed val set, layout- and rank-invariant val_loss)
    metrics     metrics.jsonl, W&B, the per-step numbers, MFU
    optim       the optimizer and the learning-rate schedule
    preemption  SIGTERM/SIGUSR1 -> one agreed checkpoint on every rank

Must not import: any command (trainer.train, trainer.prepare, trainer.report, ...).
"""
