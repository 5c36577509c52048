"""packtrain: distributed GPT training with sequence packing that does not change the objective.

The commands (`python -m trainer.X`) sit at the root, over the rooms below (train, prepare, report, export and
generate are thin shells; inspect_mask still holds its own rendering):
    train         the Hydra entry point: config -> process group -> trainer.run.loop.Trainer
    prepare       text -> tokenizer + WebDataset shards + manifest.json (trainer.data.prepare)
    report        compare run directories (trainer.reporting)
    inspect_mask  an HTML view of a packed row's attention mask, positions and labels
    export        a checkpoint -> a Hugging Face directory (GPT2LMHeadModel, LlamaForCausalLM or
                  Qwen2ForCausalLM)
    generate      sample from a checkpoint or an export
    evaluate      downstream scores of a checkpoint or an export on multiple-choice and continuation tasks
                  (trainer.tasks: every query+choice a document of a packed row)
    harness       lm-evaluation-harness on a checkpoint (PacktrainLM: lm-eval's model interface over
                  trainer.tasks)
    certify       the user's own config trained cell by cell (layouts, kernels, accumulation, parallel
                  layouts) against the unpacked one-process fp32 reference: certificate.md / .json
                  (trainer.run.certify)
    launcher      torchrun, ending as its first failed rank ended (its one line and exit status)
    config        the typed config (RunConfig) and the rules that span sections
    errors        UserError and the one way a command prints a user's mistake
    registry      which config keys preserve the loss; every metric and summary key, with its meaning
    outputs       where a command may write: never inside an input, never over a file it did not write

The rooms, from the bottom up (each imports only from rooms listed before it; tests/test_architecture.py):
    data/         shards -> documents -> packed rows -> batches; data/prepare/: the offline preparation
    model/        the single-device GPT (GPT-2 and Llama families), its attention backends and losses
    distributed/  process groups and the engines (DDP, FSDP2, DeepSpeed) that wrap a model
    checkpoint/   the checkpoint store, safe loading, weights, the Hugging Face mapping
    tasks/        downstream tasks: task files, built-ins from the held-out split, packed scoring, metrics
    reporting/    runs compared from their files: verdicts, tables, plots, HTML
    run/          the training loop, the step, eval, metrics, optimizer, preemption
"""
