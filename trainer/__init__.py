"""packtrain: distributed GPT training with sequence packing that does not change the objective.

The commands (`python -m trainer.X`) sit at the root, over the rooms below (train, export and generate are thin
shells; prepare, report and inspect_mask still hold much of their own logic):
    train         the Hydra entry point: config -> process group -> trainer.run.loop.Trainer
    prepare       text -> tokenizer + WebDataset shards + manifest.json
    report        compare run directories (verdicts, tables, plots)
    inspect_mask  an HTML view of a packed row's attention mask, positions and labels
    export        a checkpoint -> a GPT-2 Hugging Face directory
    generate      sample from a checkpoint or an export
    config        the typed config (RunConfig) and the rules that span sections
    errors        UserError and the one way a command prints a user's mistake
    registry      which config keys preserve the loss; every metric and summary key, with its meaning

The rooms, from the bottom up (each imports only from rooms listed before it; tests/test_architecture.py):
    data/         shards -> documents -> packed rows -> batches
    model/        the single-device GPT, its attention backends and losses
    distributed/  process groups and the engines (DDP, DeepSpeed) that wrap a model
    checkpoint/   the checkpoint store, safe loading, weights, the Hugging Face mapping
    run/          the training loop, the step, eval, metrics, optimizer, preemption
"""
