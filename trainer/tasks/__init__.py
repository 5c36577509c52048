"""Downstream tasks: what a checkpoint scores beyond the held-out loss (`python -m trainer.evaluate`).

    tasks     the task files (llm-foundry's jsonl forms: multiple choice and language modeling), checked line
              by line into `Task`s of `Item`s; one `TaskFileError` line names the file and line of a bad row
    builtins  tasks made from the held-out split (the true continuation among 4, a last-word cloze), seeded,
              so a run has a downstream score offline
    scoring   each query + choice a document in the project's own rows (packed or one per row), its choice's
              log-likelihood read from the model's per-token losses; items split over ranks, results gathered
    metrics   acc, acc_norm, greedy acc, bits per byte and standard errors from the per-item log-likelihoods
    suite     the tasks a user names, loaded and scored together (trainer.evaluate and train.eval_tasks)

The room reads data through trainer.data (tokenizer, rows, held-out documents) and the model through its
forward; it must not import trainer.run, trainer.config or the commands (the loop and `trainer.evaluate`
import it, not the reverse).
"""
