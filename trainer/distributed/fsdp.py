"""FSDP2 (`torch.distributed.fsdp.fully_shard`) behind the `Engine` interface (trainer.distributed.engine).

The model is sharded (`apply_fsdp`, called by trainer.distributed.engine.parallelize in its order: after
tensor parallelism, activation checkpointing and compile) over the run's loss mesh (`ParallelDims.loss_mesh`,
the `fsdp` dimension of trainer/distributed/dims.py's DeviceMesh), one `fully_shard`
per transformer block and one on the root (the embeddings, the tied head, the final norm), as torchtitan does:
every parameter becomes a DTensor holding 1/W of its rows, a block's weights are all-gathered for its forward
and again for its backward, and its gradients are reduce-scattered. The shard dimension is the mesh's `fsdp`
group (trainer/distributed/dims.py): data x context flattened (torchtitan's dp_shard_cp), the whole world
without tensor parallelism, so context parallelism adds a mesh dimension, not a code path.

The objective is DDP's: FSDP2 averages gradients over the mesh (W ranks), so `grad_average_factor` is W, as
for DDP, and what remains is sum(token losses) / global valid targets. Every forward is collective (the
all-gather), so all ranks run the same number of micro-batches (`micro_steps`: the step pads the
shorter ranks with empty ones, as for ZeRO); gradients are reduce-scattered on the last micro-batch alone
(`set_requires_gradient_sync`), so accumulation costs no communication.

bf16 (train.dtype): FSDP2's MixedPrecisionPolicy, bf16 parameters for the compute (all-gathered in bf16) and
fp32 gradient reduction, fp32 master weights and optimizer state; the loss is computed in fp32 by the model.
The root does not cast its inputs (`cast_forward_inputs=False`): the loss weights (1/3, ...) stay fp32.

The optimizer and LR schedule are the client's, built on the model before it is sharded: `fully_shard`
replaces every parameter by a DTensor, and `apply_fsdp` puts those into the optimizer's parameter groups in
place (by name; the optimizer has no state yet), so the schedule keeps its optimizer (accelerate does the
same).

Tensor parallelism (distributed.tensor_parallel, trainer/distributed/tensor.py) is applied first; FSDP2 then
shards each rank's tensor-parallel shards over its fsdp group (the ranks of one tensor rank), so a rank holds
1/(W x T) of a split weight. The partial gradients are summed over the tensor group and the norm combined over
both groups (the layout adapter's `clip_gradients`).

Checkpoints: torch.distributed.checkpoint (DCP), every rank writing its shards in parallel into the directory
the checkpoint store names (`save_shards`); DCP reshards on load, so a checkpoint written on W ranks loads on
any number (`converts_from` is False: no conversion step). Under tensor parallelism the ranks of a tensor
group hold different tensors under one name, so the checkpoint holds the whole tensors instead, their rows
split over every rank (the layout adapter's `TensorParallel._to_whole`, one whole tensor gathered at a time):
it loads on any data, tensor and FSDP2 size. Loading never runs code: DCP's reader unpickles its `.metadata`
file with plain pickle and its non-tensor entries with `torch.load(weights_only=False)`; `SafeReader` and
`SafePlanner` read them with an allow-list of DCP's own metadata classes and with `weights_only=True` instead,
in the same read (nothing to re-check between a check and the load).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
import warnings
from pathlib import Path, PurePosixPath

import torch
import torch.distributed as dist
import torch.distributed.checkpoint
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from trainer.distributed.config import DistributedConfig
from trainer.distributed.ddp import ClientOptimizerSteps, forward_backward, repoint_optimizer
from trainer.distributed.groups import DistInfo
from trainer.distributed.tensor import Unsplit
from trainer.errors import UserError


class FSDP2Engine(ClientOptimizerSteps):
    """Model + client optimizer + client LR schedule, sharded by `fully_shard` over the run's mesh."""

    name = "fsdp2"
    shard_format = "dcp"
    gathers_weights = True
    """What the checkpoint store writes the shards as (it names the directory)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, info: DistInfo,
                 grad_clip: float, tensor: Unsplit | None = None):
        """`model` already sharded by `apply_fsdp` (trainer.distributed.engine.parallelize does it, in its
        order), `optimizer` over its DTensors. `tensor`: the model's tensor layout
        (trainer.distributed.tensor: `Unsplit`, or a `TensorParallel` applied first, whose shards are sharded
        again over the fsdp group); every state and gradient operation goes through it."""
        self.module = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.grad_clip = grad_clip
        self.is_main = info.is_main
        self.tensor = tensor or Unsplit()
        # the fsdp group: data x context, flattened (trainer/distributed/dims.py)
        self.mesh = info.dims.loss_mesh
        self.grad_average_factor = self.mesh.size()

    def micro_steps(self, own: int, busiest: int) -> int:
        """The busiest rank's number of micro-batches: each forward all-gathers a block's weights, on every
        rank."""
        return max(1, busiest)

    def micro_step(self, inputs: dict, loss_scale: float,
                   sync: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Forward + backward of one micro-batch; gradients are reduce-scattered only when `sync` (the step's
        last micro-batch), accumulated unsharded before it."""
        self.module.set_requires_gradient_sync(sync)
        return forward_backward(self.module, inputs, loss_scale)

    @torch.no_grad()
    def eval_forward(self, inputs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Summed token loss, target count and per-group sums; collective (each block's weights are
        gathered)."""
        out = self.module(**inputs, return_logits=False)
        return out.loss_sum, out.num_targets, out.group_loss_sums

    def clip_gradients(self) -> float:
        """The global gradient norm before clipping (the shards' norms combined over the mesh); clips in
        place."""
        limit = self.grad_clip if self.grad_clip > 0 else float("inf")
        return self.tensor.clip_gradients(list(self.module.named_parameters()), limit, self.mesh.get_group())

    def state_dict(self) -> dict:
        raise NotImplementedError(_SHARDED)

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError(_SHARDED)

    def converts_from(self, world_size: int) -> bool:
        return False  # DCP loads a checkpoint written on any number of ranks

    def convert_shards(self, directory: Path, out: Path) -> None:
        raise NotImplementedError("DCP reshards on load (converts_from is False): "
                                  "there is nothing to convert")

    def _dcp_state(self) -> dict:
        """Model and optimizer as DCP's state-dict helpers give them (DTensor shards keyed by parameter name,
        the optimizer's state created if it has none yet), as the tensor layout writes them (under tensor
        parallelism each whole tensor, its rows split over every rank: `TensorParallel.saved_dcp_state`), and
        the schedule."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optimizer = self.tensor.saved_dcp_state(*get_state_dict(self.module, self.optimizer))
        return {"model": model, "optimizer": optimizer, "scheduler": self.scheduler.state_dict()}

    def save_shards(self, directory: Path) -> None:
        """Collective: every rank writes its shards into `directory` (DCP: one .distcp file per rank, and rank
        0 the `.metadata`). A write that fails on this rank (a full disk) is raised after DCP's save has ended
        on every rank (DCP gathers the ranks' outcomes before it raises); one that failed on another rank
        alone is not raised here: the store's agreement over the ranks reports it."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            dcp.save(self._dcp_state(), storage_writer=FileSystemWriter(directory))
        except CheckpointException as e:  # a BaseException: the store catches OSError / RuntimeError
            own = e.failures.get(dist.get_rank())
            if own is not None:
                failure = own[0] if isinstance(own, tuple) else own
                raise (failure if isinstance(failure, (OSError, RuntimeError))
                       else RuntimeError(str(failure))) from e

    def load_shards(self, directory: Path, converted: bool = False) -> None:
        """Collective: the shards DCP wrote into `directory`, on any number of ranks, resharded for this
        run's; read without running code (SafeReader, SafePlanner)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model, optimizer, back = self.tensor.dcp_load_targets(*get_state_dict(self.module, self.optimizer))
        state = {"model": model, "optimizer": optimizer, "scheduler": self.scheduler.state_dict()}
        try:
            with dcp_logs_silenced():
                dcp.load(state, storage_reader=SafeReader(directory), planner=SafePlanner())
        except CheckpointException as e:
            # a BaseException, raised on every rank once DCP gathered the failures
            raise DCPLoadError(f"cannot load the FSDP2 checkpoint {directory}: {_first_failure(e)}; "
                               "resume from another checkpoint") from None
        model, optimizer = back(state["model"], state["optimizer"])
        set_state_dict(self.module, self.optimizer, model_state_dict=model, optim_state_dict=optimizer)
        self.scheduler.load_state_dict(state["scheduler"])

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Collective: the whole model's weights on the CPU, on rank 0 ({} elsewhere), gathered from the
        shards one tensor at a time: over the fsdp group, then (tensor parallelism) the tensor group."""
        from torch.distributed.tensor import DTensor

        out = {}
        for name, v in self.module.state_dict().items():
            v = v.full_tensor() if isinstance(v, DTensor) else v
            v = self.tensor.full_state({name: v}, everywhere=False).get(name)
            if self.is_main:
                out[name] = v.detach().cpu().contiguous()
        return out


def apply_fsdp(model: nn.Module, optimizer: torch.optim.Optimizer, info: DistInfo, cfg: DistributedConfig,
               dtype: str) -> None:
    """`fully_shard` each transformer block, then the root, over the run's fsdp group (`info.dims.loss_mesh`),
    in place; the optimizer (fresh: no state yet) is given the DTensors that replace its parameters, by
    name."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if info.mesh is None:
        raise RuntimeError("FSDP2 shards over the run's DeviceMesh: call trainer.distributed.groups."
                           "init_distributed(cfg) with distributed.engine=fsdp2 first")
    if optimizer.state:
        raise ValueError("FSDP2 takes a fresh optimizer (it has state): fully_shard replaces the parameters "
                         "it was built on")
    if cfg.offload and info.device.type == "cpu":
        raise ValueError("distributed.offload=true keeps FSDP2's shards on the CPU between uses; this run's "
                         "device is the CPU already: drop it (or run on CUDA)")
    bf16 = dtype == "bf16"
    precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                                     reduce_dtype=torch.float32 if bf16 else None)
    root_precision = MixedPrecisionPolicy(param_dtype=precision.param_dtype,
                                          reduce_dtype=precision.reduce_dtype, cast_forward_inputs=False)
    offload = CPUOffloadPolicy(pin_memory=info.device.type == "cuda") if cfg.offload else OffloadPolicy()
    names = {id(p): name for name, p in model.named_parameters()}
    mesh = info.dims.loss_mesh
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=precision, offload_policy=offload,
                    reshard_after_forward=cfg.reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=root_precision, offload_policy=offload,
                reshard_after_forward=cfg.reshard_after_forward)
    repoint_optimizer(optimizer, model, names)  # the DTensors into the client's optimizer



def read_dcp_weights(directory: Path, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Not collective, no process group: the whole model's weights (`shapes`: name -> whole shape) read on the
    CPU from the DCP checkpoint save_shards wrote into `directory` on any number of ranks (its optimizer state
    is left unread), with the same safe reader as load_shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    state = {"model": {name: torch.empty(shape) for name, shape in shapes.items()}}
    try:
        with dcp_logs_silenced(), warnings.catch_warnings():
            # one process, on purpose
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=SafeReader(directory),
                     planner=SafePlanner(allow_partial_load=True), no_dist=True)
    except CheckpointException as e:
        raise DCPLoadError(f"cannot read the model's weights from the FSDP2 checkpoint {directory}: "
                           f"{_first_failure(e)}") from None
    return state["model"]


_SHARDED = ("FSDP2's state is sharded over the ranks: the engine saves it through DCP (save_shards); "
            "shard_format is 'dcp'")


# ---------------------------------------------------------------------------------------------------
# DCP's files, read without running code
# ---------------------------------------------------------------------------------------------------

DCP_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size", "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
              "bool"},
    # a layout by its name ("torch.strided"), as weights_only=True allows
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath"},  # StorageMeta.checkpoint_id
    "collections": {"OrderedDict"},
}
"""The only globals a DCP `.metadata` pickle may name (what torch 2.13's DCP writes for packtrain's
states)."""


class UnsafeDCPFileError(UserError, pickle.UnpicklingError):
    """A DCP file that would need more than plain data, tensors and DCP's metadata types to unpickle."""


class DCPLoadError(UserError):
    """A DCP checkpoint that cannot be loaded (damaged, or refused by SafeReader / SafePlanner): one line."""


def _first_failure(e: BaseException) -> str:
    """The first line of the first rank's failure inside DCP's CheckpointException (its own text
    otherwise)."""
    failures = getattr(e, "failures", None) or {}
    for rank in sorted(failures):
        failure = failures[rank]
        failure = failure[0] if isinstance(failure, tuple) else failure
        text = str(failure).strip()
        if text:
            return text.splitlines()[0]
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


class _NotFromDCP(logging.Filter):
    """Drops the records that DCP's own modules log (through the root logger)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.pathname.startswith(_DCP_SOURCE)


_DCP_SOURCE = os.path.dirname(torch.distributed.checkpoint.__file__)
_DCP_LOGGER = "torch.distributed.checkpoint"


@contextlib.contextmanager
def dcp_logs_silenced():
    """DCP's own log records dropped while it loads. Its loader logs a failure to read the `.metadata` as a
    warning with the traceback, through the root logger, on every rank, before it raises; the error it raises
    then is ours to report (DCPLoadError: one line)."""
    root, package = logging.getLogger(), logging.getLogger(_DCP_LOGGER)
    own, level = _NotFromDCP(), package.level
    root.addFilter(own)
    package.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        root.removeFilter(own)
        package.setLevel(level)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in DCP_METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        raise UnsafeDCPFileError(f"it names {module}.{name}, which is not one of DCP's metadata types")


def confined(directory: Path, name: str, what: str) -> Path:
    """`directory / name`, refused (DCPLoadError) unless it lies inside `directory`: a relative name, no `..`,
    no symlink leading out. A checkpoint received from elsewhere reads nothing but its own files (the
    checkpoint store applies the same rule to the other files: trainer.checkpoint.integrity.inside).

    Example: confined(dcp, "../../../../outside/x.distcp", "its .metadata stores 'model.wte.weight' in") ->
    "its .metadata stores 'model.wte.weight' in '../../../../outside/x.distcp' leaves the checkpoint ('..');
    ..."."""
    pure = PurePosixPath(name)
    why = "an absolute path" if pure.is_absolute() else "'..'" if ".." in pure.parts else None
    path = directory / name
    resolved, root = path.resolve(), directory.resolve()
    if why is None and resolved != root and root not in resolved.parents:
        why = f"a symlink to {resolved}"
    if why is not None:
        raise DCPLoadError(f"{what} {name!r} leaves the checkpoint ({why}); a checkpoint reads only files "
                           "inside its own directory: refused (it was forged or damaged)")
    return path


class SafeReader(FileSystemReader):
    """DCP's file reader, but its `.metadata` is unpickled with an allow-list (`DCP_METADATA_CLASSES`) instead
    of plain pickle, and every storage file it names must lie inside the checkpoint's directory (`confined`),
    checked before any is read. Tensors it reads with weights_only=True already."""

    def set_up_storage_reader(self, metadata, is_coordinator: bool, *args, **kwargs) -> None:
        directory = Path(self.path)
        for index, info in (metadata.storage_data or {}).items():
            confined(directory, str(info.relative_path), f"its .metadata stores {index.fqn!r} in")
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.filesystem import _metadata_fn
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = confined(Path(self.path), _metadata_fn, "its entry")
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except FileNotFoundError:
            raise
        except Exception as e:
            raise UnsafeDCPFileError(f"{path}: refused to load: {e}; packtrain never unpickles a "
                                     "checkpoint's files beyond plain data, tensors and DCP's own "
                                     "metadata types") from e
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner, but the non-tensor entries (optimizer hyperparameters, the schedule) are read with
    `torch.load(weights_only=True)` (DefaultLoadPlanner uses weights_only=False)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UnsafeDCPFileError(f"the entry {read_item.dest_index.fqn!r} of a DCP checkpoint needs more "
                                     f"than plain data to unpickle ({first}): refused") from e
        if self.flatten_state_dict:  # what DefaultLoadPlanner.load_bytes does with the object it unpickled
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
