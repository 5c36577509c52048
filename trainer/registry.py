"""The registry: what each config key means for a comparison, and what each metric and summary key holds.

One owner for these decisions: `trainer.report` reads the class of every config key
from CONFIG_KEYS, and `trainer.run.metrics` refuses to log a metric or summary key that is not in METRIC_KEYS
or SUMMARY_KEYS. tests/test_registry.py fails when the composed config gains a key that is not here, when a
key here no longer exists, and when a real run writes a key that is not here. Stdlib only: this module is the
bottom layer of the package and imports nothing from it.

Config keys are the dotted paths of a run's config.json (the resolved Hydra config): "packing.layout",
"logging.wandb.mode"; a list is one leaf ("optim.betas"). Each has one of four classes:

    ignored         never changes what the run computes: not shown, not compared
    same objective  must not change the loss of any step: runs differing only here must agree step by step
                    (the report checks the numbers, so a key wrongly placed here shows as "not comparable")
    ablation        changes the objective on purpose: compared at equal documents per step
    other           a different experiment: not comparable step by step

When you add a config key, add it to CONFIG_KEYS with its class and why; a metric, to METRIC_KEYS (and
docs/metrics.md's table) or SUMMARY_KEYS with its meaning.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

# The files of a run dir that hold these keys (written by trainer.run, read by trainer.report).
CONFIG_FILE = "config.json"
"""The resolved config: the keys of CONFIG_KEYS."""
METRICS_FILE = "metrics.jsonl"
"""One line per logged step: keys of METRIC_KEYS."""
SUMMARY_FILE = "summary.json"
"""The run's totals: keys of SUMMARY_KEYS."""
DOC_KEYS_DIR = "doc_keys"
"""logging.record_doc_keys: rank_NNNNN.jsonl per rank, the keys of the documents each step trained on."""

IGNORED = "ignored"
SAME_OBJECTIVE = "same objective"
ABLATION = "ablation"
OTHER = "other"
CLASSES = (IGNORED, SAME_OBJECTIVE, ABLATION, OTHER)

# ---------------------------------------------------------------------------------------------------
# Config keys: key -> (class, why). Every leaf of the composed config is listed; a trailing `.*` covers a
# whole section (only Hydra's own, which config.json does not hold but a hand-built config may).
# ---------------------------------------------------------------------------------------------------

CONFIG_KEYS: dict[str, tuple[str, str]] = {
    "seed": (OTHER, "seeds model init, data order and dropout"),
    "hydra.*": (IGNORED, "Hydra's own settings: run and sweep directories, launcher"),
    # train
    "train.seq_len": (OTHER, "row length: which chunks long documents are split into"),
    "train.tokens_per_step": (OTHER, "the batch size"),
    "train.micro_batch_tokens": (SAME_OBJECTIVE, "gradient accumulation: "
                                                 "the step's loss is over all micro-batches"),
    "train.max_steps": (OTHER, "the cosine schedule decays to max_steps: a different lr at every step"),
    "train.grad_clip": (OTHER, "changes the updates"),
    "train.dtype": (OTHER, "bf16 rounding moves the loss beyond the fp32 tolerance"),
    "train.compile": (SAME_OBJECTIVE, "the same blocks, compiled (tested against eager)"),
    "train.checkpoint_every": (IGNORED, "checkpoint cadence"),
    "train.keep_last": (IGNORED, "checkpoint retention"),
    "train.save_weights": (IGNORED, "which checkpoints hold the whole weights"),
    "train.resume": (IGNORED, "a resumed run continues the same steps"),
    "train.overwrite": (IGNORED, "where an earlier run in the same run dir is moved; "
                                 "this run computes the same"),
    "train.init_from": (OTHER, "different starting weights"),
    "train.warmup_marked_steps": (SAME_OBJECTIVE, "only flags steps in metrics "
                                                  "(and so the steady-state means)"),
    "train.eval_every": (SAME_OBJECTIVE, "eval cadence: "
                                         "eval draws no random number and reads no training document"),
    "train.eval_docs": (OTHER, "a different held-out set: val_loss not comparable"),
    "train.eval_layout": (SAME_OBJECTIVE, "the same val_loss in either layout"),
    "train.eval_tasks": (SAME_OBJECTIVE, "downstream scores: the model in eval mode, no random number drawn, "
                                         "no training document read"),
    "train.eval_tasks_every": (SAME_OBJECTIVE, "the downstream scores' cadence, like train.eval_every"),
    "train.eval_tasks_layout": (SAME_OBJECTIVE, "how the downstream tasks are scored: "
                                                "the same scores in every layout"),
    "train.on_nonfinite": (SAME_OBJECTIVE, "decides only what a non-finite step does; "
                                           "finite steps are the same"),
    "train.activation_checkpointing": (SAME_OBJECTIVE, "recomputes activations: same loss and gradients"),
    "tokenizer.add_tokens": (OTHER, "a larger vocabulary"),
    # loss
    "loss.normalization": (ABLATION, "how token losses become the objective"),
    "loss.chunk_tokens": (SAME_OBJECTIVE, "the head and loss N positions at a time: same loss and gradients"),
    # data
    "data.path": (OTHER, "different data"),
    "data.urls": (OTHER, "different data"),
    "data.val_urls": (OTHER, "a different held-out set"),
    "data.tokenizer": (OTHER, "a different tokenizer"),
    "data.split": (OTHER, "different data"),
    "data.num_workers": (SAME_OBJECTIVE, "the same documents per step whatever the worker count"),
    "data.shuffle_buffer": (OTHER, "a different document order"),
    "data.on_error": (SAME_OBJECTIVE, "decides only what a bad sample does; "
                                      "on clean data the steps are the same"),
    "data.retries": (SAME_OBJECTIVE, "a retried shard skips the samples it already gave"),
    "data.read_timeout_s": (SAME_OBJECTIVE, "a stalled read is retried like any transient failure: "
                                            "the same samples"),
    "data.max_doc_mb": (SAME_OBJECTIVE, "a bound on bad input, like data.on_error: a larger document is an "
                                        "error, or skipped and counted; "
                                        "on data within it the steps are the same"),
    "data.loss_on": (OTHER, "different targets"),
    "data.prefetch": (SAME_OBJECTIVE, "the same rows and order, drawn in a background thread"),
    "data.sources": (OTHER, "different data: other sources or other weights"),
    "data.mix_exhausted": (OTHER, "changes which documents a mixture's epochs hold"),
    "data.balance": (SAME_OBJECTIVE, "whole rows move between the ranks of one step: the same documents, "
                                     "targets and denominator"),
    "data.epoch_lockstep": (OTHER, "changes which documents the steps after a reader's first epoch see"),
    # packing
    "packing.layout": (SAME_OBJECTIVE, "the same documents per step in every layout"),
    "packing.buffer_size": (OTHER, "changes which documents each step holds"),
    "packing.long_docs": (OTHER, "split, truncate or drop: different targets"),
    "packing.reset_positions": (ABLATION, "continuous positions across a packed row"),
    "packing.pad_to": (SAME_OBJECTIVE, "padding carries no target"),
    # model
    "model.vocab_size": (OTHER, "a different model"),
    "model.n_layer": (OTHER, "a different model"),
    "model.n_head": (OTHER, "a different model"),
    "model.n_embd": (OTHER, "a different model"),
    "model.max_seq_len": (OTHER, "sizes the position table: a different init"),
    "model.dropout": (OTHER, "a different model"),
    "model.bias": (OTHER, "a different model"),
    "model.pos_emb": (ABLATION, "learned vs rotary positions"),
    "model.rope_theta": (OTHER, "a different model"),
    "model.init_std": (OTHER, "a different init"),
    "model.norm": (OTHER, "a different model"),
    "model.norm_eps": (OTHER, "a different model"),
    "model.mlp": (OTHER, "a different model"),
    "model.mlp_hidden": (OTHER, "a different model"),
    "model.n_kv_head": (OTHER, "a different model"),
    "model.qkv_bias": (OTHER, "a different model"),
    "model.tie_embeddings": (OTHER, "a different model"),
    "model.rope_scaling": (OTHER, "a different model"),
    "model.family": (SAME_OBJECTIVE, "names the Hugging Face class the weights export as: the same model"),
    # attention
    "attention.backend": (SAME_OBJECTIVE, "every kernel computes the same attention"),
    "attention.isolate_documents": (ABLATION, "documents of a packed row attend to earlier ones"),
    "attention.flex_compile": (SAME_OBJECTIVE, "the same FlexAttention, fused or eager"),
    # optim
    "optim._target_": (OTHER, "a different optimizer"),
    "optim.lr": (OTHER, "optimizer hyperparameter"),
    "optim.betas": (OTHER, "optimizer hyperparameter"),
    "optim.eps": (OTHER, "optimizer hyperparameter"),
    "optim.weight_decay": (OTHER, "optimizer hyperparameter"),
    "optim.warmup_steps": (OTHER, "schedule hyperparameter"),
    "optim.min_lr_ratio": (OTHER, "schedule hyperparameter"),
    "optim.fused": (SAME_OBJECTIVE, "one kernel for the same update"),
    # distributed
    "distributed.engine": (SAME_OBJECTIVE, "DDP, DeepSpeed and FSDP2 apply the same update"),
    "distributed.backend": (SAME_OBJECTIVE, "the same reductions"),
    "distributed.device": (SAME_OBJECTIVE, "the same computation (fp32)"),
    "distributed.zero_stage": (SAME_OBJECTIVE, "shards state, not the update"),
    "distributed.offload": (SAME_OBJECTIVE, "where the optimizer state lives"),
    "distributed.reshard_after_forward": (SAME_OBJECTIVE, "when gathered weights are freed, "
                                                          "not what is computed"),
    "distributed.context_parallel": (SAME_OBJECTIVE, "the same rows, split over ranks by position: same loss "
                                     "and gradients"),
    "distributed.tensor_parallel": (SAME_OBJECTIVE, "each layer's weights split over ranks: "
                                                    "same loss and gradients"),
    "distributed.context_parallel_strategy": (SAME_OBJECTIVE, "how attention crosses the group, "
                                                              "not what it computes"),
    "distributed.context_parallel_split": (SAME_OBJECTIVE, "which positions each rank holds, "
                                                           "not what is computed"),
    # logging
    "logging.log_every": (IGNORED, "which steps are written"),
    "logging.progress": (IGNORED, "the progress bar"),
    "logging.record_doc_keys": (IGNORED, "an audit file"),
    "logging.length_buckets": (IGNORED, "which per-length token losses are logged"),
    "logging.position_buckets": (IGNORED, "which per-position token losses are logged"),
    "logging.wandb.mode": (IGNORED, "W&B"),
    "logging.wandb.project": (IGNORED, "W&B"),
    "logging.wandb.entity": (IGNORED, "W&B"),
    "logging.wandb.group": (IGNORED, "W&B"),
    "logging.wandb.tags": (IGNORED, "W&B"),
    # not in config.json: trainer.report adds it to a run's config from its summary.json
    "world_size": (SAME_OBJECTIVE, "the ranks split the same rows of each step"),
}

FROM_SUMMARY = {"world_size"}
"""Config keys that trainer.report takes from a run's summary.json (config.json does not hold them)."""

OLDER_RUN_VALUES: dict[str, Any] = {
    "loss.normalization": "global_tokens",
    "data.loss_on": "all",
    "tokenizer.add_tokens": (),
    "distributed.context_parallel": 1,
    "distributed.context_parallel_strategy": "allgather",
    "distributed.context_parallel_split": "zigzag",
    "distributed.tensor_parallel": 1,
}
"""Values of keys that older runs' config.json lacks: how their trainer behaved before the key existed."""

LAYOUT_INVARIANT_NORMALIZATIONS = {"global_tokens", "document_mean"}
"""Values of loss.normalization under which the layout, micro-batching and world size leave the loss unchanged
(under micro_batch_mean and row_mean they change it, on purpose: the report says by how much)."""


def config_key_class(key: str) -> str | None:
    """The class of a dotted config key: its own entry, else a `section.*` entry covering it;
    None if unregistered.

    Example: "packing.layout" -> "same objective", "hydra.run.dir" -> "ignored", "model.pos_emb" ->
    "ablation", "seed" -> "other", "train.no_such_key" -> None.
    """
    if key in CONFIG_KEYS:
        return CONFIG_KEYS[key][0]
    return next((cls for pattern, (cls, _) in CONFIG_KEYS.items()
                 if pattern.endswith(".*") and key.startswith(pattern[:-1])), None)


# ---------------------------------------------------------------------------------------------------
# Metric keys: one JSON line per logged step in <run dir>/metrics.jsonl (and W&B). Values are global (all
# ranks) unless said otherwise. Some keys appear only on some steps or some runs (see each line).
# ---------------------------------------------------------------------------------------------------

METRIC_KEYS: dict[str, str] = {
    "step": "optimizer steps done, counting from 1 (a resumed run continues the count)",
    "loss": "the optimized objective of the step, under loss.normalization",
    "token_loss": "sum of token losses / valid targets of the step: `loss` under global_tokens, comparable "
                  "across normalizations",
    "token_loss_by_length": "per document-length bucket (logging.length_buckets; a chunk of a split document "
                            "by its own length): sum of its token losses / its targets in the step, all "
                            "ranks (null: no target in that bucket)",
    "targets_by_length": "targets of the step per document-length bucket, all ranks",
    "token_loss_by_position": "per bucket of the target's position in its document "
                              "(logging.position_buckets; a chunk of a split document counts from its "
                              "start): sum of its token losses / its targets in the step, all ranks "
                              "(null: no target there)",
    "targets_by_position": "targets of the step per position bucket, all ranks",
    "token_loss_by_source": "per source of the mixture (data.sources only): sum of its token losses / its "
                            "targets in the step, all ranks (null: no target from that source)",
    "targets_by_source": "targets of the step per source of the mixture, all ranks (data.sources only)",
    "tokens_by_source": "document tokens (non-padding positions) of the step per source, all ranks "
                        "(data.sources only)",
    "docs_by_source": "documents (chunks of split ones counted once each) of the step per source, all ranks "
                      "(data.sources only)",
    "token_share_by_source": "tokens_by_source / all document tokens of the step (data.sources only)",
    "target_share_by_source": "each source's weight / the sum of the weights: the share the mixer aims at, "
                              "constant (data.sources only)",
    "lr": "the learning rate this step used",
    "grad_norm": "global gradient norm before clipping",
    "valid_tokens": "targets of the step (tokens the loss counts)",
    "allocated_tokens": "positions of the step's batches, padding included",
    "token_utilization": "non-padding positions / allocated positions",
    "docs": "documents (and chunks of split documents) in the step",
    "docs_per_row": "docs / rows of the step",
    "valid_tokens_per_s": "valid_tokens / step_time_s",
    "allocated_tokens_per_s": "allocated_tokens / step_time_s",
    "step_time_s": "wall time of the step on rank 0 (data, forward, backward, update)",
    "data_time_s": "the part of step_time_s spent waiting for the step's rows",
    "elapsed_s": "training wall time so far (sum of step_time_s; eval and checkpoints excluded)",
    "skipped_steps": "steps dropped so far for a non-finite loss or gradient (train.on_nonfinite=skip)",
    "nonfinite": "true if this step's loss or gradient norm was NaN/inf (its update was not applied)",
    "peak_mem_gb": "peak memory so far on rank 0: CUDA allocator peak, or the process's peak RSS on CPU",
    "warmup": "true for the first train.warmup_marked_steps steps (left out of the summary's means)",
    "compile_recompiles": "dynamo recompilations so far (train.compile=true only)",
    "model_flops": "the step's useful FLOPs, all ranks: 6 x matmul parameters per real token + causal "
                   "attention of each document over itself, forward and backward (trainer.run.flops)",
    "hardware_flops": "the FLOPs the step's kernels computed, all ranks: padding, the attention pairs of "
                      "this layout and kernel, activation recompute (trainer.run.flops); >= model_flops",
    "mfu": "model FLOPs utilization: model_flops / step_time_s / the devices' peak bf16 FLOP/s (CUDA devices "
           "in PEAK_FLOPS only)",
    "hfu": "hardware FLOPs utilization: hardware_flops / step_time_s / the devices' peak bf16 FLOP/s "
           "(as mfu)",
    "cp_imbalance": "context parallelism only: max / mean - 1 of the work (6 N per position + attention "
                    "pairs of its queries, under distributed.context_parallel_split) of the ranks of rank "
                    "0's group on its micro-batches of the step; 0 = even (logged steps)",
    "cp_kv_bytes": "context parallelism only: bytes of keys and values this rank received in the step "
                   "(forward all-gathers, and their gradients' reduce-scatters back, every layer; its tensor "
                   "rank's heads): distributed.context_parallel_split=documents exchanges only split "
                   "documents' (logged steps)",
    "dp_imbalance": "several data ranks only: max / mean - 1 of the modeled work (the model FLOPs of each "
                    "data rank's rows: 6 N per token + each document's attention pairs) over the data ranks; "
                    "0 = even; with data.balance=rows after the deal (logged steps)",
    "dp_compute_imbalance": "several data ranks only: max / mean - 1 of the measured compute of each data "
                            "rank (from the step's counts to its last block's gradient: "
                            "trainer.run.step.ComputeClock), "
                            "the measured counterpart of dp_imbalance (logged steps)",
    "dp_wait_s": "several data ranks only: the longest time a data rank waited at the step's gradient "
                 "reduction after its own backward (a faster rank waiting for the slowest; plus the last "
                 "bucket's communication). Under FSDP2 the ranks also meet at every layer, so part of the "
                 "wait is inside the compute (logged steps)",
    "dp_imbalance_drawn": "data.balance=rows only: dp_imbalance of the rows as the ranks drew them, before "
                          "the deal (logged steps)",
    "val_loss": "held-out loss: sum of token losses / eval targets, all ranks (eval steps only)",
    "val_ppl": "exp(val_loss) (eval steps only)",
    "val_tokens": "eval targets, all ranks (eval steps only)",
    "val_docs": "eval documents, chunks of split ones counted once each, all ranks (eval steps only)",
    "val_token_loss_by_length": "token_loss_by_length of the eval set (eval steps only)",
    "val_targets_by_length": "eval targets per document-length bucket (eval steps only)",
    "val_token_loss_by_position": "token_loss_by_position of the eval set (eval steps only)",
    "val_targets_by_position": "eval targets per position bucket (eval steps only)",
    "val_token_loss_by_source": "token_loss_by_source of the eval set, each source's held-out documents "
                                "(eval steps of a mixture only; null for a source without held-out shards)",
    "val_targets_by_source": "eval targets per source (eval steps of a mixture only)",
    "eval_time_s": "wall time of the evaluation (eval steps only)",
    "tasks": "train.eval_tasks' downstream scores, per task: n, acc, acc_stderr, bits_per_byte, and acc_norm "
             "(multiple choice) or loglikelihood (language modeling) with their standard errors "
             "(task steps only)",
    "tasks_time_s": "wall time of scoring train.eval_tasks (task steps only)",
    "epoch": "the epoch of the step's documents, from 0 (data.epoch_lockstep only: every rank starts an "
             "epoch at the same step)",
    "lockstep_wait_steps": "steps so far in which some rank had fewer rows than its share because its "
                           "readers had finished the epoch (data.epoch_lockstep only)",
    "epoch_lockstep_wait_steps": "lockstep_wait_steps of this step's epoch so far (data.epoch_lockstep only)",
    "resume_samples_read": "samples the readers of all ranks re-read to restore their positions (first step "
                           "after a resume only)",
    "resume_bytes_read": "bytes read from shards to restore the readers' positions "
                         "(first step after a resume only)",
}

# ---------------------------------------------------------------------------------------------------
# Summary keys: <run dir>/summary.json, written by rank 0 when the run ends (and W&B's run summary).
# ---------------------------------------------------------------------------------------------------

SUMMARY_KEYS: dict[str, str] = {
    "logged_steps": "non-warm-up steps this process logged (for a resumed run: since the resume); the means "
                    "below are over them",
    "mean_token_utilization": "mean token_utilization of those steps",
    "mean_valid_tokens_per_s": "sum of valid_tokens / sum of step_time_s over those steps",
    "mean_allocated_tokens_per_s": "sum of allocated_tokens / sum of step_time_s over those steps",
    "mean_model_flops_per_s": "sum of model_flops / sum of step_time_s over those steps",
    "mean_hardware_flops_per_s": "sum of hardware_flops / sum of step_time_s over those steps",
    "mean_mfu": "mfu over those steps, weighted by step time: the model FLOPs done / the peak's (null "
                "without a known peak)",
    "mean_hfu": "hfu over those steps, weighted by step time (null without a known peak)",
    "final_step": "the step the run ended at",
    "final_loss": "loss of the last logged step",
    "final_val_loss": "val_loss of the last evaluation (null without eval)",
    "final_val_ppl": "val_ppl of the last evaluation (null without eval)",
    "final_val_token_loss_by_length": "val_token_loss_by_length of the last evaluation (null without eval)",
    "final_val_token_loss_by_position": "val_token_loss_by_position of the last evaluation "
                                        "(null without eval)",
    "final_val_token_loss_by_source": "val_token_loss_by_source of the last evaluation (data.sources only; "
                                      "null without eval)",
    "token_share_by_source": "each source's document tokens over all steps / all document tokens of the run "
                             "(data.sources only)",
    "target_share_by_source": "each source's weight / the sum of the weights (data.sources only)",
    "mixture": "per source, what rank 0's mixture handed out (rows' documents and tokens) and its weight, "
               "passes read through, passes cut short and the documents those left untrained "
               "(trainer.data.mixture; data.sources only)",
    "val_tokens": "eval targets of the last evaluation (null without eval)",
    "val_docs": "eval documents of the last evaluation (null without eval)",
    "loss_normalization": "loss.normalization of the run",
    "wandb_group": "the W&B group (logging.wandb.group, the sweep directory's name, or one derived from the "
                   "model)",
    "world_size": "ranks the run trained on",
    "elapsed_s": "training wall time (sum of step times, a resumed run's earlier steps included)",
    "peak_mem_gb": "peak memory of rank 0 over the run",
    "total_valid_tokens": "targets trained on, all steps",
    "total_allocated_tokens": "positions allocated, padding included, all steps",
    "total_docs": "documents (and chunks) trained on, all steps",
    "skipped_steps": "steps dropped for a non-finite loss or gradient",
    "skipped_samples": "samples skipped under data.on_error=skip, by reason (rank 0's readers)",
    "lockstep_wait_steps": "steps in which some rank had fewer rows than its share because its readers had "
                           "finished the epoch (null without data.epoch_lockstep)",
    "lockstep_wait_steps_by_epoch": "lockstep_wait_steps per epoch, from epoch 0 (resumed from a checkpoint "
                                    "older than this count: counted from the resume)",
    "resume_samples_read": "samples re-read to restore the readers after a resume (null: a fresh start)",
    "resume_bytes_read": "bytes re-read to restore the readers after a resume (null: a fresh start)",
    "packing_stats": "rank 0's packer counts: documents and tokens in, split, truncated, dropped, and the "
                     "tokens trained without their document's start "
                     "(the chunks after a split document's first)",
    "dtype": "train.dtype as run: fp32 or bf16",
    "optimizer_fused": "whether the optimizer ran its fused kernel (optim.fused)",
    "compile": "train.compile",
    "compile_frames": "dynamo compilations, first ones and recompilations (null without compile)",
    "compile_recompiles": "dynamo recompilations (null without compile)",
    "compile_recompile_reasons": "dynamo's reasons for the latest recompilations (compile only)",
    "preempted": "the signal that stopped the run early, or null",
    "run_dir": "the run directory",
    "checkpoint": "the last checkpoint written, or null",
}


def check_metric_keys(keys: Iterable[str]) -> None:
    """Raise ValueError naming each key that METRIC_KEYS does not hold
    (trainer.run.metrics logs nothing else).

    Example: check_metric_keys(["step", "los"]) -> ValueError "metrics.jsonl key 'los' is not registered:
    register it in trainer/registry.py (METRIC_KEYS) with a one-line meaning".
    """
    _require(keys, METRIC_KEYS, "METRIC_KEYS", METRICS_FILE)


def check_summary_keys(keys: Iterable[str]) -> None:
    """Raise ValueError naming each key that SUMMARY_KEYS does not hold
    (as check_metric_keys, for summary.json)."""
    _require(keys, SUMMARY_KEYS, "SUMMARY_KEYS", SUMMARY_FILE)


def _require(keys: Iterable[str], table: Mapping[str, str], name: str, where: str) -> None:
    missing = sorted(set(keys) - table.keys())
    if len(missing) == 1:
        raise ValueError(f"{where} key {missing[0]!r} is not registered: register it in trainer/registry.py "
                         f"({name}) with a one-line meaning")
    if missing:
        raise ValueError(f"{where} keys {', '.join(map(repr, missing))} are not registered: register them in "
                         f"trainer/registry.py ({name}) with a one-line meaning each")
