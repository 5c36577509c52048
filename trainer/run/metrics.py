"""Metrics: one JSON line per logging step in <run dir>/metrics.jsonl, the same values to W&B.

Only rank 0 writes. Every key, with its meaning, is registered in trainer/registry.py (METRIC_KEYS per step,
SUMMARY_KEYS for summary.json): `MetricsLogger` refuses a key that is not, on every rank.
"""

from __future__ import annotations

import json
import os
import re
import resource
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from trainer.config import WandbConfig
from trainer.data.feed import LossGroups, StepRows, length_bucket_names
from trainer.distributed.groups import DistInfo
from trainer.registry import DOC_KEYS_DIR, METRICS_FILE, check_metric_keys, check_summary_keys
from trainer.run.run_dir import truncate_jsonl_after

# Dense (no 2:4 sparsity) bf16 tensor-core peak FLOP/s per device, for MFU and HFU (the FLOP counts:
# trainer.run.flops). Add yours; unknown devices get no `mfu` / `hfu`. NVIDIA's datasheets quote the
# sparse rate in their "BF16 Tensor Core" row (marked "with sparsity"); the dense rate is half of it:
#   NVIDIA H200 Tensor Core GPU datasheet: H200 SXM 1,979 -> 989 TFLOP/s, H200 NVL 1,671 -> 835
#   NVIDIA H100 Tensor Core GPU datasheet: H100 SXM 1,979 -> 989, H100 NVL 1,671 -> 835,
#                                          H100 PCIe 1,513 -> 756
#   NVIDIA A100 Tensor Core GPU datasheet: 312 dense (624 sparse), SXM and PCIe, 40 and 80 GB alike
#   NVIDIA L40S / L40 / L4 / A10 datasheets: 733 -> 362, 362 -> 181, 242 -> 121, 250 -> 125
# Keys match torch.cuda.get_device_name() ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB")
# as whole words, first match wins: the variants come before their family ("H100 PCIe" before "H100"),
# and "A10" does not match "A100" or "A10G", nor "L4" "L40S".
PEAK_FLOPS = {
    "GH200": 989e12,
    "H200 NVL": 835e12,
    "H200": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "A10": 125e12,
}


def peak_flops_for_name(name: str) -> float | None:
    """Dense bf16 peak FLOP/s of the device called `name`, or None if it is not in PEAK_FLOPS.

    Example: "NVIDIA H100 PCIe" -> 756e12; "NVIDIA A100-SXM4-80GB" -> 312e12; "NVIDIA A10G" -> None.
    """
    return next((flops for key, flops in PEAK_FLOPS.items() if re.search(rf"\b{re.escape(key)}\b", name)),
                None)


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return peak_flops_for_name(torch.cuda.get_device_name(device))


def by_group(groups: LossGroups, loss_sums: Sequence[float] | None, targets: Sequence[int] | None,
             prefix: str = "") -> dict:
    """The per-group metrics of a step or an eval, from the sums and targets of each loss group (source x
    length bucket x position bucket, trainer.data.batch.LossGroups), as marginal tables: with length buckets
    prefix + "token_loss_by_length" {bucket: summed token loss / targets over every source, None for a bucket
    without targets} and prefix + "targets_by_length" {bucket: targets}; with a mixture the same by source
    ("token_loss_by_source", "targets_by_source"); with position buckets by position in the document
    ("token_loss_by_position", "targets_by_position"); {} when not measured.

    Example: sources (a, b), edges (64,), sums [6.0, 0.0, 1.0, 4.0], targets [3, 0, 1, 2] ->
    {"token_loss_by_length": {"<=64": 7 / 4, ">64": 4 / 2}, "targets_by_length": {"<=64": 4, ">64": 2},
     "token_loss_by_source": {"a": 6 / 3, "b": 5 / 3}, "targets_by_source": {"a": 3, "b": 3}}.
    """
    if not groups.size or loss_sums is None:
        return {}
    shape = (groups.num_sources, groups.num_buckets, groups.num_positions)
    sums_SKP, targets_SKP = (np.asarray(loss_sums, dtype=float).reshape(shape),
                             np.asarray(targets).reshape(shape))
    out = {}
    for present, key, names, axes in ((groups.edges, "by_length", length_bucket_names(groups.edges), (0, 2)),
                                      (groups.sources, "by_source", groups.sources, (1, 2)),
                                      (groups.positions, "by_position", length_bucket_names(groups.positions),
                                       (0, 1))):
        if present:
            out |= _loss_table(f"{prefix}{{}}_{key}", names, sums_SKP.sum(axis=axes).tolist(),
                               targets_SKP.sum(axis=axes).tolist())
    return out


def _loss_table(key: str, names: Sequence[str], loss_sums: Sequence[float], targets: Sequence[int]) -> dict:
    """{key.format("token_loss"): {name: sum / targets or None}, key.format("targets"): {name: targets}}."""
    return {key.format("token_loss"): {n: (s / t if t else None) for n, s, t in zip(names, loss_sums, targets,
                                                                                 strict=True)},
            key.format("targets"): dict(zip(names, (int(t) for t in targets), strict=True))}


def by_source(names: Sequence[str], weights: Sequence[float], tokens: Sequence[int] | None,
              docs: Sequence[int] | None = None) -> dict:
    """The mixture's per-source counts of a step (or a run, `docs` None): tokens_by_source and docs_by_source,
    token_share_by_source (its tokens / all tokens; None when there are none) and target_share_by_source (its
    weight / the sum of the weights, what the mixer aims at); {} without a mixture.

    Example: names (a, b), weights (3, 1), tokens [60, 40], docs [2, 5] ->
    {"tokens_by_source": {"a": 60, "b": 40}, "docs_by_source": {"a": 2, "b": 5},
    "token_share_by_source": {"a": 0.6, "b": 0.4}, "target_share_by_source": {"a": 0.75, "b": 0.25}}.
    """
    if not names or tokens is None:
        return {}
    total = sum(tokens)
    out = {"tokens_by_source": dict(zip(names, tokens, strict=True))}
    if docs is not None:
        out["docs_by_source"] = dict(zip(names, docs, strict=True))
    out["token_share_by_source"] = {n: (t / total if total else None)
                                    for n, t in zip(names, tokens, strict=True)}
    out["target_share_by_source"] = {n: w / sum(weights) for n, w in zip(names, weights, strict=True)}
    return out


def step_metrics(step: int, stats, lr: float, step_time: float, data_time: float, counters: dict,
                 groups: LossGroups, source_weights: Sequence[float], device: torch.device, warmup: bool,
                 epochs: StepRows | None, compile_recompiles: int | None) -> dict:
    """One step's metrics line (every key in trainer.registry.METRIC_KEYS): the objective and the step's loss
    groups, the learning rate and gradient norm, the token counts and rates, the run's totals so far
    (`counters`, the Trainer's), the epoch and its lockstep waits (`epochs`: the ranks' StepRows with
    data.epoch_lockstep, else None), and train.compile's recompilations (None without it). `stats`:
    trainer.run.step.StepStats."""
    m = {
        "step": step,
        "loss": stats.loss,
        "token_loss": stats.token_loss,
        **by_group(groups, stats.group_loss_sums, stats.group_targets),
        **by_source(groups.sources, source_weights, stats.source_tokens, stats.source_docs),
        "lr": lr,
        "grad_norm": stats.grad_norm,
        "valid_tokens": stats.valid_tokens,
        "allocated_tokens": stats.allocated_tokens,
        "token_utilization": stats.real_tokens / stats.allocated_tokens,
        "docs": stats.docs,
        "docs_per_row": stats.docs / stats.rows,
        "valid_tokens_per_s": stats.valid_tokens / step_time,
        "allocated_tokens_per_s": stats.allocated_tokens / step_time,
        "step_time_s": step_time,
        "data_time_s": data_time,
        "elapsed_s": counters["elapsed_s"],
        "skipped_steps": counters["skipped_steps"],
        "nonfinite": not stats.finite,
        "peak_mem_gb": peak_mem_gb(device),
        "warmup": warmup,
    }
    if epochs is not None:
        m.update(epoch=epochs.epoch, lockstep_wait_steps=sum(epochs.wait_steps),
                 epoch_lockstep_wait_steps=epochs.wait_steps[-1])
    if compile_recompiles is not None:
        m["compile_recompiles"] = compile_recompiles
    return m


def run_summary(*, final_step: int, final_loss: float | None, last_eval, counters: dict, groups: LossGroups,
                source_weights: Sequence[float], mixture, epochs: StepRows | None, skipped_samples: dict,
                packing_stats: dict, resume_read: dict, compile_counter, device: torch.device, **run) -> dict:
    """summary.json's run-specific keys (every key in trainer.registry.SUMMARY_KEYS; `MetricsLogger.summary`
    adds the means over the logged steps): the final step, loss and eval (`last_eval`:
    trainer.run.evals.EvalResult or None), the run's totals (`counters`), what the readers skipped and read to
    resume, the packing counts, the lockstep waits by epoch (`epochs` as in `step_metrics`), train.compile's
    counts (`compile_counter`: trainer.model.compile.CompileCounter or None), a mixture's shares and
    per-source counts (`mixture`: its `summary()`, None without one), and `run`: how the run ran (world_size,
    dtype, preempted, checkpoint, ...)."""
    ev = last_eval
    waits = epochs.wait_steps if epochs is not None else None
    out = {
        "final_step": final_step,
        "final_loss": final_loss,
        "final_val_loss": ev.val_loss if ev else None,
        "final_val_ppl": ev.val_ppl if ev else None,
        "final_val_token_loss_by_length": ev.val_token_loss_by_length if ev else None,
        "final_val_token_loss_by_position": ev.val_token_loss_by_position if ev else None,
        "val_tokens": ev.val_tokens if ev else None,
        "val_docs": ev.val_docs if ev else None,
        "elapsed_s": counters["elapsed_s"],
        "peak_mem_gb": peak_mem_gb(device),
        "total_valid_tokens": counters["valid_tokens"],
        "total_allocated_tokens": counters["allocated_tokens"],
        "total_docs": counters["docs"],
        "skipped_steps": counters["skipped_steps"],
        "skipped_samples": skipped_samples,
        "lockstep_wait_steps": None if waits is None else sum(waits),
        "lockstep_wait_steps_by_epoch": waits,
        **resume_read,
        "packing_stats": packing_stats,
        **_compile_summary(compile_counter),
        **run,
    }
    if groups.sources:  # a mixture: the last eval's loss per source, the token shares beside the targets
        shares = by_source(groups.sources, source_weights, counters["tokens_by_source"])
        out.update(final_val_token_loss_by_source=ev.val_token_loss_by_source if ev else None,
                   token_share_by_source=shares["token_share_by_source"],
                   target_share_by_source=shares["target_share_by_source"], mixture=mixture)
    return out


def _compile_summary(counter) -> dict:
    """train.compile's counts: dynamo compilations, recompilations and their latest reasons."""
    if counter is None:
        return {"compile": False, "compile_frames": None, "compile_recompiles": None}
    return {"compile": True, "compile_frames": counter.compiles, "compile_recompiles": counter.recompiles,
            "compile_recompile_reasons": counter.reasons()}


def peak_mem_gb(device: torch.device) -> float:
    """Peak memory so far: CUDA allocator peak on GPU, the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return rss_kb / 2**20


class MetricsLogger:
    """Appends metrics to metrics.jsonl and W&B on rank 0; a no-op elsewhere."""

    def __init__(self, run_dir: str | Path, cfg: WandbConfig, resolved_config: dict, tags: list[str],
                 group: str | None, enabled: bool, resume_step: int = 0, log_every: int = 1) -> None:
        self.enabled = enabled
        self.log_every = log_every
        """logging.log_every: write every N optimizer steps (see `due`)."""
        self.path = Path(run_dir) / METRICS_FILE
        self.wandb_run = None
        self._totals = {"valid_tokens": 0, "allocated_tokens": 0, "time": 0.0, "utilization": 0.0, "steps": 0}
        self._flop_totals = {"model_flops": 0.0, "hardware_flops": 0.0, "mfu": None, "hfu": None}
        """Over the same steps: FLOPs, and mfu / hfu weighted by step time (None while no step had one)."""
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._truncate_after(resume_step)  # a fresh run (step 0) in an old run dir starts a fresh file
        if cfg.mode != "disabled":
            self.wandb_run = _init_wandb(run_dir, cfg, resolved_config, tags, group)

    def _truncate_after(self, step: int) -> None:
        truncate_jsonl_after(self.path, step)

    def due(self, step: int, last: bool, forced: bool = False) -> bool:
        """Whether step `step` is written: every `log_every` steps, the last step, and any step `forced` to be
        (one with an eval, the first after a resume, a non-finite one).
        Example: log_every=10 -> 10, 20, ..."""
        return forced or last or step % self.log_every == 0

    def log(self, metrics: dict) -> None:
        """Append one step's metrics;
        a ValueError for a key not registered in trainer/registry.py (METRIC_KEYS)."""
        check_metric_keys(metrics)
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(metrics) + "\n")
        if not metrics.get("warmup", False):
            t = self._totals
            t["valid_tokens"] += metrics["valid_tokens"]
            t["allocated_tokens"] += metrics["allocated_tokens"]
            t["time"] += metrics["step_time_s"]
            t["utilization"] += metrics["token_utilization"]
            t["steps"] += 1
            self._add_flops(metrics)
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=metrics["step"])

    def summary(self, extra: dict) -> dict:
        """Totals and means over the non-warm-up steps logged by this process, and `extra`; a ValueError for a
        key not registered in trainer/registry.py (SUMMARY_KEYS)."""
        t = self._totals
        out = {
            "logged_steps": t["steps"],
            "mean_token_utilization": t["utilization"] / t["steps"] if t["steps"] else None,
            "mean_valid_tokens_per_s": t["valid_tokens"] / t["time"] if t["time"] else None,
            "mean_allocated_tokens_per_s": t["allocated_tokens"] / t["time"] if t["time"] else None,
            **self._flop_means(),
            **extra,
        }
        check_summary_keys(out)
        if self.wandb_run is not None:
            self.wandb_run.summary.update({k: v for k, v in out.items() if v is not None})
        return out

    def _add_flops(self, metrics: dict) -> None:
        f = self._flop_totals
        for key in ("model_flops", "hardware_flops"):
            f[key] += metrics.get(key, 0.0)
        for key in ("mfu", "hfu"):
            if key in metrics:
                f[key] = (f[key] or 0.0) + metrics[key] * metrics["step_time_s"]

    def _flop_means(self) -> dict:
        """mean_model_flops_per_s, mean_hardware_flops_per_s, mean_mfu, mean_hfu over the non-warm-up logged
        steps: summed FLOPs (or utilization x seconds) / summed seconds, so mean_mfu = the FLOPs done / the
        peak's."""
        f, seconds = self._flop_totals, self._totals["time"]
        return {
            "mean_model_flops_per_s": f["model_flops"] / seconds if seconds else None,
            "mean_hardware_flops_per_s": f["hardware_flops"] / seconds if seconds else None,
            "mean_mfu": f["mfu"] / seconds if seconds and f["mfu"] is not None else None,
            "mean_hfu": f["hfu"] / seconds if seconds and f["hfu"] is not None else None,
        }

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


class DocKeysLog:
    """<run dir>/doc_keys/rank_NNNNN.jsonl: {"step": s, "keys": [...]} per step, the documents (and chunks,
    `key#k`) this rank trained on, in order. Every rank writes its own file."""

    def __init__(self, run_dir: str | Path, info: DistInfo, resume_step: int) -> None:
        self.path = Path(run_dir) / DOC_KEYS_DIR / f"rank_{info.rank:05d}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        truncate_jsonl_after(self.path, resume_step)
        # resumed on fewer ranks: the files of the ranks gone lose their steps after the resume too
        if info.is_main:
            for path in self.path.parent.glob("rank_*.jsonl"):
                if path.stem[5:].isdigit() and int(path.stem[5:]) >= info.world_size:
                    truncate_jsonl_after(path, resume_step)

    def log(self, step: int, keys: list[str]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, "keys": keys}) + "\n")


def _init_wandb(run_dir, cfg: WandbConfig, resolved_config: dict, tags: list[str], group: str | None):
    import wandb

    if cfg.mode == "online" and not (os.environ.get("WANDB_API_KEY") or _has_netrc_key()):
        print("wandb: mode=online but no API key is configured; falling back to offline", file=sys.stderr)
        mode = "offline"
    else:
        mode = cfg.mode
    return wandb.init(
        project=cfg.project,
        entity=cfg.entity,
        group=cfg.group or group,
        tags=sorted(set(tags) | set(cfg.tags)),
        config=resolved_config,
        dir=str(run_dir),
        mode=mode,
        resume="allow",
        id=_run_id(run_dir),
    )


def _run_id(run_dir) -> str:
    """One W&B run per run directory, so a resumed run continues its own W&B run."""
    path = Path(run_dir) / "wandb_run_id"
    if not path.exists():
        path.write_text(uuid.uuid4().hex[:8])
    return path.read_text().strip()


def _has_netrc_key() -> bool:
    netrc = Path.home() / ".netrc"
    return netrc.exists() and "api.wandb.ai" in netrc.read_text()
