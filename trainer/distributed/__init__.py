"""Distributed: process groups and the engines that wrap a built model for several ranks.

    groups     `init_distributed` (the only place a process group is made), `DistInfo`, the named
               collectives (`dist_sum`, `dist_max`, `barrier`, `broadcast_object`)
    collectives  all-gather and reduce-scatter along a dimension (NCCL's, or gloo's all-reduce and a slice)
    dims       `ParallelDims`: the world as data x context x tensor ranks, its DeviceMesh and named groups
               (data, loss, fsdp, context, tensor), always built; whoever asks "which data rank am I" asks it
    engine     the `Engine` protocol the step, eval and checkpoint store talk to, and `parallelize`, the one
               function that wraps a model (tensor parallel first, then activation checkpointing, then
               compile, then DDP, FSDP2 or DeepSpeed)
    tensor     tensor parallelism with sequence parallelism, applying the model's `tensor_plan`:
               column/row-parallel layers, the vocabulary split and padded, the loss on vocabulary shards; and
               the layout adapter every engine calls without asking which it is (`Unsplit`, `TensorParallel`:
               whole tensors for checkpoints and optimizer state, gradient clipping, whether weights must be
               gathered)
    ddp        `DDPEngine` (torch DistributedDataParallel)
    fsdp       `FSDP2Engine` (torch fully_shard over the run's mesh; DCP checkpoints, confined reads)
    context    context parallelism: a packed row split over a group's ranks, documents exact (allgather,
               ulysses)
    deepspeed  `DeepSpeedEngine` (ZeRO 1/2/3), imported only when configured
    config     the `distributed` config section

Engines hand their state to the checkpoint store; they do not choose file names. Must not import: the
checkpoint, run or config modules, or any command (it may import the model and data rooms below it).
"""
