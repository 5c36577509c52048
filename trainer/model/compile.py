"""torch.compile for training (train.compile=true): each transformer block compiled on its own, as torchtitan
does.

`compile_blocks` runs once, from `trainer.distributed.engine.parallelize`, before any DDP / DeepSpeed
wrapping. Every block has the same code, so dynamo compiles it once and all blocks reuse the graphs (guards
hold for each block).

What is compiled: a block's body (`Block._forward`: layer norms, qkv projection, RoPE, output projection,
residuals, MLP). What is not: the attention kernel call, `segment_attention`, which `compile_blocks` wraps in
`torch.compiler.disable` for each block (`CausalSelfAttention.attend`; not at import, where it would load
dynamo into every process). Its inputs change with every batch: cu_seqlens has one entry per document,
max_seqlen is a Python int, and sdpa_docs is a Python loop over the documents (one graph per document count).
Outside the graph they cost nothing: no guard on them, so no recompilation per batch, whatever the backend:

    block body, part 1 (compiled)  ->  attention kernel (eager: flash / varlen / flex / sdpa_docs / dense)
                                   ->  block body, part 2 (compiled)

flash and varlen are single fused kernels anyway; flex compiles its own kernel (attention.flex_compile). The
body, not the module call, is compiled so that train.activation_checkpointing=full keeps working: its
`torch.utils.checkpoint` call around the body stays outside the graph (dynamo cannot trace a checkpointed
region holding a graph break and would run the whole block eagerly).

Recompilations to expect, each once per run: a micro-batch shape not seen before makes the dims dynamic
(automatic dynamic shapes; unpacked and bucketed rows vary in length, packed ones rarely do), and the first
evaluation (no_grad) compiles the inference graphs. `CompileCounter` counts them for the metrics.
"""

from __future__ import annotations

import torch
from torch import nn

_EAGER_ATTENTION = "per-batch boundaries: cu_seqlens length, max_seqlen, the sdpa_docs loop"


def compile_blocks(model: nn.Module, **compile_kwargs) -> nn.Module:
    """Compile each block's body in place (parameter names, and so checkpoints, unchanged); returns the model.

    compile_kwargs go to torch.compile (tests pass backend="eager" to trace without inductor).
    Example: compile_blocks(build_model(cfg, attention)); the first forward compiles (seconds), later ones
    reuse.
    """
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise TypeError("train.compile compiles the transformer blocks of `model.blocks`; "
                        f"{type(model).__name__} has none")
    for block in blocks:
        body = getattr(block, "_forward", None)
        if body is None:
            raise TypeError(f"{type(block).__name__} has no `_forward` "
                            "(the block body that train.compile compiles)")
        attend = getattr(getattr(block, "attn", None), "attend", None)
        if attend is None:
            raise TypeError(f"{type(block).__name__} has no `attn.attend` "
                            "(the attention call train.compile keeps out of the graphs)")
        # eager, between the graphs
        block.attn.attend = torch.compiler.disable(attend, reason=_EAGER_ATTENTION)
        # an instance attribute: not a parameter, not in the state dict
        block._forward = torch.compile(body, **compile_kwargs)
    return model


class CompileCounter:
    """Counts dynamo's compilations while registered: `compiles` (every frame compiled, the first time and
    again) and `recompiles` (a frame compiled again because its guards failed: a new shape, grad mode, ...).

    torch numbers each compilation "frame/count" (torch._guards.CompileId): count > 0 is a recompilation, the
    same test as TORCH_LOGS=recompiles. `reasons()` gives dynamo's own reasons for the latest ones.
    Example: counter = CompileCounter(); ...train...; counter.recompiles -> 2; counter.close().
    """

    def __init__(self) -> None:
        from torch._dynamo.callback import CallbackTrigger, callback_handler

        self._trigger = CallbackTrigger.DYNAMO
        self._handler = callback_handler
        self.compiles = 0
        self.recompiles = 0
        self._handler.register_start_callback(self._on_start)

    def _on_start(self, args) -> None:
        if args.callback_trigger != self._trigger:  # e.g. a lazily compiled backward: not a new frame compile
            return
        self.compiles += 1
        frame_compile = str(args.compile_id).rpartition("/")[2]
        if frame_compile.isdigit() and int(frame_compile) > 0:
            self.recompiles += 1

    @staticmethod
    def reasons(limit: int = 5) -> list[str]:
        """Dynamo's reasons for the latest recompilations (first line of each, distinct, at most `limit`)."""
        from torch._dynamo.utils import get_compilation_metrics

        found: list[str] = []
        for metrics in get_compilation_metrics():
            reason = getattr(metrics, "recompile_reason", None)
            line = reason.strip().splitlines()[0] if reason else None
            if line and line not in found:
                found.append(line)
        return found[-limit:]

    def close(self) -> None:
        """Stop counting (the counts stay readable)."""
        try:
            self._handler.remove_start_callback(self._on_start)
        except ValueError:  # already removed, e.g. by torch._dynamo.reset()
            pass
