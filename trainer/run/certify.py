"""The certificate: does this run's configuration (model, data, kernels, parallel layout, dtype) compute the
objective it claims? Every cell of a matrix trains the same few steps of the user's own model on the same
documents of the user's own data, and is held to ONE reference that shares the least with it:

    reference   unpacked (one document a row), one process, fp32, the dense kernel, the whole step one
                micro-batch, positions from 0 in every row: nothing to isolate, no boundary to get wrong
    cells       one process: every layout (packed, unpacked, bucketed) x gradient accumulation (1 and the
                config's) on the config's kernel, and the packed layout on every other kernel this machine
                trains with; under torchrun: DDP, rows dealt by work, FSDP2, DeepSpeed ZeRO-2, tensor
                parallel 2 and context parallel 2 (each split), packed, on the config's kernel

Each cell runs the steps twice from the same initial weights (dropout off: its masks differ by layout): at lr
0, where every step sees the same weights and so must give the reference's loss, and its first step the
reference's gradient; then at the run's lr, where the losses must follow the reference's trajectory. Per cell:

    loss        max over steps (both passes) of |loss - reference| / |reference|
    gradients   per tensor, the first step's: cosine, and max |g - g_ref| / max |g_ref| (the tensor's own
                scale); under DeepSpeed (gradients partitioned inside ZeRO) and tensor parallelism (sharded
                per tensor) the first step's global gradient norm instead
    leakage     one-process packed cells: each document of the step's fullest row changed in turn (every token
                another); the positions of the row's other documents whose logits move by more than the
                kernel's own noise (the same row run twice) are counted: any is a leak

Tolerance: fp32 cells 1e-5 relative (FP32_RTOL). A bf16 cell is another rounding of the same sums, so it is
held to BF16_NOISE_FACTOR times the distance of the unpacked one-process bf16 run from the fp32 reference
(measured in the same run: the "noise" row of the certificate), the loss and the gradients each by their own,
never below the fp32 tolerance. A cell this machine cannot run (a kernel missing, a parallel size the launch
does not allow) is listed as skipped with the reason, never as passed.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from trainer.checkpoint.weights import init_from_checkpoint
from trainer.config import RunConfig, resolve_dtype
from trainer.data.feed import DataSource, Document, collate_rows, micro_batches
from trainer.distributed.config import DistributedConfig, missing_engine_package
from trainer.distributed.context import with_row_plans
from trainer.distributed.engine import parallelize
from trainer.distributed.groups import DistInfo, init_distributed
from trainer.errors import UserError
from trainer.model import build_model, compute_dtype, model_inputs, resolve_backend
from trainer.model.attention import AUTO_ORDER
from trainer.run.inputs import RowDealer
from trainer.run.optim import build_optimizer, build_scheduler
from trainer.run.step import train_step

FP32_RTOL = 1e-5
"""fp32 cells: the relative loss and gradient difference allowed (summation order only)."""
BF16_NOISE_FACTOR = 3.0
"""bf16 cells: allowed this many times the unpacked bf16 run's own distance from the fp32 reference."""
PROBE_DOCUMENTS = 4
"""The leakage probe changes at most this many documents of the row, one at a time."""
REFERENCE_BACKEND = "dense"
"""The reference's kernel: one explicit mask, the simplest there is (fp32 on any device)."""
LAYOUTS = ("packed", "unpacked", "bucketed")


@dataclass
class Cell:
    """One configuration certified against the reference."""

    layout: str
    backend: str
    dtype: str
    micro_batch_tokens: int
    accumulation: int
    parallel: str = "one process"
    """'one process', or the parallel layout: 'ddp', 'ddp, rows dealt', 'fsdp2', 'deepspeed zero-2', 'tp 2',
    'cp 2 (split)'."""
    distributed: DistributedConfig | None = None
    balance: bool = False
    skipped: str | None = None
    """Why this machine or launch cannot run the cell (it is then neither passed nor failed)."""

    @property
    def name(self) -> str:
        return (f"{self.layout}, {self.backend}, {self.dtype}, accumulation {self.accumulation}, "
                f"{self.parallel}")


@dataclass
class Measured:
    """What a cell (or the reference) computed."""

    losses: list[float]
    """The lr-0 pass's losses, then the run-lr pass's."""
    grad_norms: list[float]
    grads: dict[str, torch.Tensor] | None
    """The first step's gradients, whole, on the CPU (None where the engine does not expose them)."""
    probe: dict | None = None
    """{'moved': positions of other documents whose logits moved, 'checked': positions checked, 'noise': the
    kernel's own run-to-run difference, 'document': the first document whose change moved any}; None: no
    probe."""
    seconds: float = 0.0


@dataclass(frozen=True)
class Tolerance:
    """What a cell may differ from the reference by, relative: its loss, and each gradient tensor (of its
    scale)."""

    loss: float = FP32_RTOL
    gradient: float = FP32_RTOL

    @classmethod
    def from_noise(cls, loss_noise: float, gradient_noise: float) -> Tolerance:
        """bf16: BF16_NOISE_FACTOR x the unpacked bf16 run's own distance from fp32, never below fp32's."""
        return cls(max(FP32_RTOL, BF16_NOISE_FACTOR * loss_noise),
                   max(FP32_RTOL, BF16_NOISE_FACTOR * gradient_noise))


@dataclass
class Verdict:
    cell: Cell
    loss_rdiff: float | None = None
    grad_rdiff: float | None = None
    grad_cosine: float | None = None
    worst_tensor: str | None = None
    probe: dict | None = None
    tolerance: Tolerance = Tolerance()
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def status(self) -> str:
        return "skipped" if self.cell.skipped else ("FAIL" if self.problems else "pass")


class CertifyError(UserError):
    """The certificate cannot be drawn for this configuration (e.g. no documents)."""


# ---------------------------------------------------------------------------------------------------
# The steps' documents
# ---------------------------------------------------------------------------------------------------


def draw_steps(data: DataSource, steps: int, rows: int) -> list[list[list[Document]]]:
    """`steps` logical batches of `rows` packer rows each, from the run's own stream (one reader: every rank
    of a launch draws the same)."""
    out = []
    for s in range(steps):
        batch = data.rows.take(rows)
        if not batch:
            raise CertifyError(f"the data gave no rows for step {s + 1} of {steps}: fewer documents than "
                               "--steps x --rows rows hold")
        out.append(batch)
    return out


# ---------------------------------------------------------------------------------------------------
# Running a cell
# ---------------------------------------------------------------------------------------------------


def _fresh_model(cfg: RunConfig, data: DataSource, backend: str, isolate: bool, device: torch.device):
    """The run's model, its initial weights (seed, or train.init_from), dropout off, on `device`."""
    torch.manual_seed(cfg.seed)
    attention = replace(cfg.attention, backend=backend, isolate_documents=isolate)
    model = build_model(replace(cfg.model, dropout=0.0), attention, vocab_size=data.vocab_size,
                        loss_chunk_tokens=cfg.loss.chunk_tokens)
    if cfg.train.init_from:
        init_from_checkpoint(model, cfg.train.init_from, data.tokenizer_dir, data.tokenizer_hash,
                             list(cfg.tokenizer.add_tokens))
    return model.to(device)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (collective), or the tensor; as fp32 on the CPU."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().cpu()


def gradients_exposed(cell: Cell) -> bool:
    """Whether the cell's gradients can be read whole per tensor: not inside DeepSpeed's ZeRO partitions, nor
    as tensor-parallel shards (those cells are held to the global gradient norm)."""
    d = cell.distributed
    return d is None or (d.engine != "deepspeed" and d.tensor_parallel == 1)


def run_cell(cfg: RunConfig, data: DataSource, steps: Sequence[list[list[Document]]], cell: Cell,
             info: DistInfo, reference: bool = False) -> Measured:
    """The cell's two passes over `steps` (lr 0, then the run's lr) and, one-process packed, the leakage
    probe. `info`: this rank's layout (a hand-built one-rank DistInfo for one-process cells)."""
    t0 = time.perf_counter()
    losses, norms, grads, module = [], [], None, None
    isolate = True if reference else cfg.attention.isolate_documents
    packing = replace(cfg.packing, layout=cell.layout,
                      reset_positions=True if reference else cfg.packing.reset_positions)
    for lr in (0.0, cfg.optim.lr):
        model = _fresh_model(cfg, data, cell.backend, isolate, info.device)
        optim = replace(cfg.optim, lr=lr)
        opt = build_optimizer(model, optim, info.device)
        engine = parallelize(model, opt, build_scheduler(opt, optim, len(steps)), info,
                             cell.distributed or DistributedConfig(device=info.device.type),
                             cfg.train.grad_clip, cell.dtype,
                             activation_checkpointing=cfg.train.activation_checkpointing)
        first: dict[str, torch.Tensor] = {}
        if lr == 0.0 and gradients_exposed(cell):
            def keep_first(*_, model=model, first=first):
                if not first:
                    first.update({n: _whole(p.grad) for n, p in model.named_parameters()
                                  if p.grad is not None})
            opt.register_step_pre_hook(keep_first)
        dealer = RowDealer(lambda row: sum(len(d) ** 2 for d in row), info) if cell.balance else None
        for rows in steps:
            mine = rows[info.data_rank::info.data_world]
            if dealer is not None:
                mine = dealer.deal(mine)
            mbs = micro_batches(mine, packing, cfg.train.seq_len, cell.micro_batch_tokens, data.pad_id)
            if info.context is not None:
                mbs = with_row_plans(mbs, info.context)
            stats = train_step(engine, mbs, info, data.pad_id, cfg.loss.normalization)
            losses.append(stats.loss)
            norms.append(stats.grad_norm)
        if lr == 0.0:
            grads, module = first or None, engine.module
    probe = None
    if cell.layout == "packed" and cell.parallel == "one process" and not reference:
        probe = leakage_probe(module, steps[0], cfg, data, cell.dtype, info.device)
    return Measured(losses, norms, grads, probe, time.perf_counter() - t0)


def _logits(module, row: list[Document], cfg: RunConfig, data: DataSource, dtype: str,
            device: torch.device) -> torch.Tensor:
    batch = collate_rows([row], cfg.train.seq_len, data.pad_id, "packed",
                         cfg.packing.reset_positions).to_device(device)
    autocast = compute_dtype(dtype) if dtype == "bf16" else None
    with torch.no_grad(), torch.autocast(device.type, dtype=autocast or torch.float32,
                                         enabled=autocast is not None):
        return module(**model_inputs(batch), return_logits=True).logits[0].float()


def leakage_probe(module, rows: list[list[Document]], cfg: RunConfig, data: DataSource, dtype: str,
                  device: torch.device) -> dict:
    """Each of the first PROBE_DOCUMENTS documents of the step's fullest row changed in turn (every token
    another); the positions of the row's other documents whose logits move by more than the same row's
    run-to-run noise."""
    row = max(rows, key=len)
    if len(row) < 2:
        return {"moved": 0, "checked": 0, "noise": 0.0, "document": None,
                "note": "no row holds two documents"}
    module.eval()
    base = _logits(module, row, cfg, data, dtype, device)
    noise = (_logits(module, row, cfg, data, dtype, device) - base).abs().max().item()
    starts = np.concatenate([[0], np.cumsum([len(d) for d in row])])
    moved = checked = 0
    first = None
    rng = np.random.default_rng(0)
    for i in range(min(PROBE_DOCUMENTS, len(row))):
        doc = row[i]
        shift = rng.integers(1, data.vocab_size, len(doc))
        changed = list(row)
        changed[i] = Document(doc.key, (doc.tokens + shift) % data.vocab_size)
        delta = (_logits(module, changed, cfg, data, dtype, device) - base).abs().amax(dim=-1)
        others = torch.ones(int(starts[-1]), dtype=torch.bool)
        others[int(starts[i]):int(starts[i + 1])] = False
        count = int((delta[:int(starts[-1])].cpu()[others] > noise).sum())
        moved += count
        checked += int(others.sum())
        if count and first is None:
            first = i
    module.train()
    return {"moved": moved, "checked": checked, "noise": noise, "document": first}


# ---------------------------------------------------------------------------------------------------
# Comparing with the reference
# ---------------------------------------------------------------------------------------------------


def distance(measured: Measured, reference: Measured) -> tuple[float, float | None, float | None, str | None]:
    """(max relative loss difference over both passes, max relative gradient difference over tensors (each
    relative to its reference's largest entry; the global norm's where the gradients are not exposed), the
    lowest per-tensor cosine, the tensor of the largest difference)."""
    loss = max(abs(a - b) / max(abs(b), 1e-12)
               for a, b in zip(measured.losses, reference.losses, strict=True))
    if measured.grads is None or reference.grads is None:
        norm = (abs(measured.grad_norms[0] - reference.grad_norms[0])
                / max(abs(reference.grad_norms[0]), 1e-12))
        return loss, norm, None, "global gradient norm"
    worst, worst_name, cosine = 0.0, None, 1.0
    for name, ref in reference.grads.items():
        got = measured.grads.get(name)
        if got is None:
            return loss, math.inf, None, f"{name} (no gradient)"
        scale = ref.abs().max().item()
        diff = (got - ref).abs().max().item() / scale if scale > 0 else (got.abs().max().item() and math.inf)
        if diff > worst:
            worst, worst_name = diff, name
        got64, ref64 = got.double(), ref.double()  # fp32 rounds a cosine of identical tensors to 1 - 1.5e-7
        norms = ref64.norm().item() * got64.norm().item()
        if norms > 0:
            cosine = min(cosine, float((got64 * ref64).sum().item() / norms))
    return loss, worst, cosine, worst_name


def judge(cell: Cell, measured: Measured, reference: Measured, tolerance: Tolerance = Tolerance()) -> Verdict:
    """The cell's verdict: within `tolerance` in loss and gradients, and no logit of another document
    moved."""
    loss, grad, cosine, tensor = distance(measured, reference)
    v = Verdict(cell, loss, grad, cosine, tensor, measured.probe, tolerance, seconds=measured.seconds)
    if not loss <= tolerance.loss:
        step = int(np.argmax([abs(a - b) / max(abs(b), 1e-12)
                              for a, b in zip(measured.losses, reference.losses, strict=True)]))
        n = len(measured.losses) // 2
        when = f"step {step % n + 1} at {'lr 0' if step < n else 'the run lr'}"
        v.problems.append(f"the loss differs from the reference by {loss:.3g} relative ({when}; tolerance "
                          f"{tolerance.loss:.3g})")
    if grad is not None and not grad <= tolerance.gradient:
        v.problems.append(f"the gradient of {tensor} differs by {grad:.3g} of its scale (tolerance "
                          f"{tolerance.gradient:.3g}"
                          + (f"; lowest cosine {cosine:.6f})" if cosine is not None else ")"))
    if measured.probe and measured.probe["moved"]:
        p = measured.probe
        v.problems.append(f"document {p['document'] + 1} of a packed row moved {p['moved']} logit positions "
                          f"of the row's other documents (of {p['checked']} checked; kernel noise "
                          f"{p['noise']:.3g})")
    return v


# ---------------------------------------------------------------------------------------------------
# The matrix
# ---------------------------------------------------------------------------------------------------


def micro_batch_count(cfg: RunConfig, rows: list[list[Document]], layout: str,
                      micro_batch_tokens: int) -> int:
    """Micro-batches of one step's `rows` in `layout` under `micro_batch_tokens` (the step's accumulation)."""
    return len(micro_batches(rows, replace(cfg.packing, layout=layout), cfg.train.seq_len,
                             micro_batch_tokens, 0))


def kernels_here(configured: str, device: torch.device, dtype: str) -> list[tuple[str, str | None]]:
    """(kernel, why it cannot train here or None) for the configured kernel first, then every other one."""
    out = []
    for backend in dict.fromkeys([configured, *AUTO_ORDER, "dense"]):
        try:
            resolve_backend(backend, device, compute_dtype(dtype), requires_grad=True)
            out.append((backend, None))
        except UserError as e:  # its reason, without the advice to use another kernel
            out.append((backend, str(e).split("; use ")[0]))
    return out


def whole_step_tokens(cfg: RunConfig, steps: Sequence[list[list[Document]]]) -> int:
    """A micro-batch budget that holds every step whole in any layout (unpacked: one document a row of
    seq_len)."""
    return max(sum(len(row) for row in step) for step in steps) * cfg.train.seq_len


def one_process_cells(cfg: RunConfig, backend: str, dtype: str, steps: Sequence[list[list[Document]]],
                      device: torch.device) -> list[Cell]:
    """Every layout x accumulation (each step one micro-batch, and the config's micro_batch_tokens) on
    `backend`, then packed at the config's accumulation on every other kernel (accumulation counted on the
    first step)."""
    step, whole = steps[0], whole_step_tokens(cfg, steps)
    sizes = dict.fromkeys([whole, cfg.train.micro_batch_tokens])
    cells = [Cell(layout, backend, dtype, mbt, micro_batch_count(cfg, step, layout, mbt))
             for layout in LAYOUTS for mbt in sizes]
    mbt = cfg.train.micro_batch_tokens
    for other, why in kernels_here(backend, device, dtype)[1:]:
        cells.append(Cell("packed", other, dtype, mbt, micro_batch_count(cfg, step, "packed", mbt),
                          skipped=why))
    return cells


def parallel_cells(cfg: RunConfig, backend: str, dtype: str, step: list[list[Document]],
                   world: int) -> list[Cell]:
    """The parallel layouts a launch of `world` ranks can run, packed on `backend` with the config's
    accumulation (counted on data rank 0's share of `step`)."""
    base = replace(cfg.distributed, engine="ddp", context_parallel=1, tensor_parallel=1)
    mbt = cfg.train.micro_batch_tokens
    acc = micro_batch_count(cfg, step[::world], "packed", mbt)
    options: list[tuple[str, DistributedConfig, bool, str | None]] = [
        ("ddp", base, False, None),
        ("ddp, rows dealt by work", base, True, None),
        ("fsdp2", replace(base, engine="fsdp2"), False, None),
    ]
    zero2 = replace(base, engine="deepspeed", zero_stage=2)
    options.append(("deepspeed zero-2", zero2, False, missing_engine_package(zero2)))
    even = None if world % 2 == 0 else f"needs an even number of ranks, the launch has {world}"
    if cfg.model.n_head % 2 and even is None:
        even = f"tensor parallel 2 needs an even model.n_head, got {cfg.model.n_head}"
    options.append(("tp 2", replace(base, tensor_parallel=2), False, even))
    cp_even = None if world % 2 == 0 else f"needs an even number of ranks, the launch has {world}"
    for split in ("balanced", "zigzag", "documents"):
        options.append((f"cp 2 ({split})",
                        replace(base, context_parallel=2, context_parallel_split=split), False, cp_even))
    return [Cell("packed", backend, dtype, mbt, acc, name, dist_cfg, balance, why)
            for name, dist_cfg, balance, why in options]


@dataclass
class Certificate:
    verdicts: list[Verdict]
    noise: dict | None
    """bf16: the unpacked one-process bf16 run's distance from the reference (loss, gradient), which sets the
    tolerance; None in fp32."""
    reference_seconds: float

    @property
    def passed(self) -> bool:
        return all(v.status != "FAIL" for v in self.verdicts)


def certify(cfg: RunConfig, data: DataSource, steps: Sequence[list[list[Document]]], device: torch.device,
            world: int = 1, progress: Callable[[str], None] = print) -> Certificate:
    """The reference, then every cell (one-process ones before the process group exists, so their sums stay on
    this rank; under a launch of `world` > 1 ranks, then the parallel ones), each judged."""
    dtype = resolve_dtype(cfg.train.dtype, device)
    backend = resolve_backend(cfg.attention.backend, device, compute_dtype(dtype), requires_grad=True)
    alone = DistInfo(0, 1, 0, device)
    whole = whole_step_tokens(cfg, steps)
    reference_cell = Cell("unpacked", REFERENCE_BACKEND, "fp32", whole, 1, "reference")
    reference = run_cell(cfg, data, steps, reference_cell, alone, reference=True)
    progress(f"reference: unpacked, {REFERENCE_BACKEND}, fp32, one micro-batch ({reference.seconds:.1f} s)")
    tolerance, noise = Tolerance(), None
    if dtype == "bf16":
        noise_cell = Cell("unpacked", backend, "bf16", whole, 1)
        measured = run_cell(cfg, data, steps, noise_cell, alone, reference=True)
        loss, grad, cosine, _ = distance(measured, reference)
        noise = {"loss": loss, "gradient": grad, "cosine": cosine}
        tolerance = Tolerance.from_noise(loss, grad or 0.0)
        progress(f"bf16 noise (unpacked, {backend}, bf16 vs the fp32 reference): loss {loss:.3g}, gradient "
                 f"{grad:.3g}; bf16 tolerance: loss {tolerance.loss:.3g}, gradient {tolerance.gradient:.3g}")
    verdicts = []
    # before any process group: sums stay here
    for cell in one_process_cells(cfg, backend, dtype, steps, device):
        verdicts.append(_judged(cfg, data, steps, cell, alone, reference, tolerance, progress))
    if world > 1:
        for cell in parallel_cells(cfg, backend, dtype, steps[0], world):
            info = None
            if cell.skipped is None:
                try:
                    info = init_distributed(cell.distributed)
                except UserError as e:
                    cell.skipped = str(e)
            verdicts.append(_judged(cfg, data, steps, cell, info, reference, tolerance, progress))
    return Certificate(verdicts, noise, reference.seconds)


def _judged(cfg, data, steps, cell: Cell, info: DistInfo | None, reference: Measured, tolerance: Tolerance,
            progress: Callable[[str], None]) -> Verdict:
    if cell.skipped is not None:
        progress(f"skipped  {cell.name}: {cell.skipped}")
        return Verdict(cell, tolerance=tolerance)
    verdict = judge(cell, run_cell(cfg, data, steps, cell, info), reference, tolerance)
    progress(f"{verdict.status:<8} {cell.name} ({verdict.seconds:.1f} s)")
    return verdict


# ---------------------------------------------------------------------------------------------------
# The certificate's files
# ---------------------------------------------------------------------------------------------------


def _num(x: float | None, spec: str = ".2e") -> str:
    return "—" if x is None else format(x, spec)


def table(cert: Certificate) -> str:
    """The verdicts as a Markdown table (what the terminal shows too)."""
    lines = ["| cell | verdict | loss rel. diff | gradient rel. diff | lowest cosine | leak probe | note |",
             "|---|---|---:|---:|---:|---|---|"]
    for v in cert.verdicts:
        probe = "—"
        if v.probe is not None:
            probe = v.probe.get("note") or f"{v.probe['moved']} of {v.probe['checked']} moved"
        note = (v.cell.skipped or "; ".join(v.problems)
                or (f"largest in {v.worst_tensor}" if v.worst_tensor else ""))
        lines.append(f"| {v.cell.name} | {v.status} | {_num(v.loss_rdiff)} | {_num(v.grad_rdiff)} | "
                     f"{_num(v.grad_cosine, '.8f')} | {probe} | {note} |")
    return "\n".join(lines)


def as_json(cert: Certificate, facts: dict) -> dict:
    """certificate.json: the facts of the run (versions, device, config) and every cell's figures."""
    cells = []
    for v in cert.verdicts:
        cell = {k: getattr(v.cell, k) for k in ("layout", "backend", "dtype", "micro_batch_tokens",
                                                "accumulation", "parallel", "balance", "skipped")}
        cells.append({"name": v.cell.name, "status": v.status, **cell, "loss_rdiff": v.loss_rdiff,
                      "grad_rdiff": v.grad_rdiff, "grad_cosine": v.grad_cosine,
                      "worst_tensor": v.worst_tensor, "probe": v.probe,
                      "tolerance": dataclasses.asdict(v.tolerance), "problems": v.problems,
                      "seconds": v.seconds})
    return {**facts, "passed": cert.passed,
            "tolerance": {"fp32": FP32_RTOL, "bf16_noise_factor": BF16_NOISE_FACTOR},
            "bf16_noise": cert.noise, "reference": {"layout": "unpacked", "backend": REFERENCE_BACKEND,
                                                    "dtype": "fp32", "seconds": cert.reference_seconds},
            "cells": cells}


def as_markdown(cert: Certificate, facts: dict) -> str:
    failed = [v for v in cert.verdicts if v.status == "FAIL"]
    skipped = [v for v in cert.verdicts if v.status == "skipped"]
    head = "PASSED" if cert.passed else f"FAILED ({len(failed)} of {len(cert.verdicts) - len(skipped)} cells)"
    lines = [f"# packtrain certificate: {head}", ""]
    lines += [f"- {k}: {v}" for k, v in facts.items() if k != "config"]
    lines += ["", f"Reference: unpacked, {REFERENCE_BACKEND} kernel, fp32, one process, the whole step one "
              f"micro-batch. Tolerance: {FP32_RTOL:g} relative in fp32"
              + (f"; bf16 {BF16_NOISE_FACTOR:g} x the unpacked bf16 run's distance from fp32 "
                 f"(loss {cert.noise['loss']:.3g}, gradient {cert.noise['gradient']:.3g})"
                 if cert.noise else "")
              + ".", "", table(cert), ""]
    if failed:
        lines += ["## What differs", ""] + [f"- **{v.cell.name}**: {'; '.join(v.problems)}"
                                            for v in failed] + [""]
    if skipped:
        lines += ["## Not checked here", ""] + [f"- {v.cell.name}: {v.cell.skipped}" for v in skipped] + [""]
    return "\n".join(lines)


def facts(cfg: RunConfig, device: torch.device, steps: Sequence[list[list[Document]]], world: int) -> dict:
    """What the certificate was drawn on: versions, device, the steps' size, the config."""
    from importlib import metadata

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {
        "packtrain": version("packtrain"), "torch": torch.__version__, "flash_attn": version("flash-attn"),
        "device": name, "ranks": world, "steps": len(steps), "rows_per_step": len(steps[0]),
        "documents": sum(len(row) for rows in steps for row in rows), "seq_len": cfg.train.seq_len,
        "dtype": resolve_dtype(cfg.train.dtype, device), "loss.normalization": cfg.loss.normalization,
        "config": cfg.resolved,
    }
