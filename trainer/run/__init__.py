"""The run: what `python -m trainer.train` does once the config is typed and the process group exists.

    loop          `Trainer`: builds the parts from a RunConfig, resumes, then runs each step and the parts in
                  order (its docstring is the loop in six lines)
    parts         what runs after a step, each owning its cadence (`due`): NonFinite, Counting, HeldOut,
                  Tasks, StepFlops, Logging, Saving (OLMo-core's callbacks); `StepEnd` is what they read
    inputs        this rank's data stream (`build_data`, from trainer.data.feed, the one data module the run
                  imports) and each step's micro-batches (`StepInputs`: rows agreed across ranks at an epoch's
                  end by trainer.data.epochs.StepRows, laid out, checked, pinned, prefetched)
    step          one optimizer step: the loss weights of the normalization, the global counts reduced once
                  across ranks, then forward/backward over the micro-batches and the update
    evals         the in-loop evals: the held-out eval (fixed val set, layout- and rank-invariant val_loss;
                  `Evaluator.due`) and the downstream tasks (`TaskScorer`, as the trainer.evaluate command
                  scores)
    checkpointer  when the run saves, with or without model.safetensors, and what it resumes from
                  (`Checkpointer.due`, `weights_due`); train.init_from's weights (`init_from`); the files are
                  the store's
    run_dir       one run per run dir: a fresh start, or another run's checkpoint, in a used one refused (or,
                  train.overwrite, the old run set aside); a resume from an older step sets the newer
                  branch aside
    conventions   what conventions.json says: how inputs and objective were built
    metrics       each step's metrics line (`step_metrics`) and summary.json (`run_summary`), written to
                  metrics.jsonl and W&B; the devices' peak FLOP/s; `MetricsLogger.due`; every key registered
                  in trainer.registry
    flops         a step's FLOPs two ways: model (the documents' useful work, for mfu) and hardware (what this
                  layout and attention kernel computed, padding and recompute included, for hfu)
    optim         the optimizer and the learning-rate schedule
    preemption    SIGTERM/SIGUSR1 -> one agreed checkpoint on every rank; a start's long phases cut short
                  (`PreemptionHandler.during`)
    certify       the certificate: a few steps of the run's config in every layout, kernel, accumulation and
                  parallel layout, each against the unpacked one-process fp32 reference (python -m
                  trainer.certify)

Must not import: any command (trainer.train, trainer.prepare, trainer.report, ...).
"""
