"""Checkpoint files that load without running code: `torch.load(weights_only=True)` and safetensors.

`torch.load(weights_only=False)` unpickles arbitrary objects, so a crafted engine or rank state file of a
checkpoint (trainer.checkpoint.store) would run code the moment a run resumes from it. Everything packtrain
saves is therefore plain Python containers, numbers, strings and tensors, which the restricted unpickler of
`weights_only=True` accepts with no allow-list at all. The one other type in the states, numpy arrays (RNG
state, buffered documents), is written as a tensor in a tagged dict and turned back into an array on load:

    save_state({"tokens": np.array([5, 9], np.int32)}, path)   # stored as {"tokens": {"__ndarray__": tensor}}
    load_state(path)["tokens"]                                 # -> array([5, 9], dtype=int32)

A file that the restricted unpickler refuses is refused here, with its name and the reason; nothing falls
back to `weights_only=False`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.errors import UserError

NDARRAY = "__ndarray__"
_VIA_INT = {np.dtype(np.uint32): np.int64, np.dtype(np.uint16): np.int32}  # dtypes torch stores poorly


class UnsafeCheckpointError(UserError):
    """A checkpoint file that cannot be loaded without running code from it (or is not a checkpoint)."""


def encode(obj: Any) -> Any:
    """Containers of numpy arrays -> the same containers with tagged tensors (everything else unchanged)."""
    if isinstance(obj, np.ndarray):
        via = _VIA_INT.get(obj.dtype)
        tensor = torch.from_numpy(np.ascontiguousarray(obj.astype(via) if via else obj))
        return {NDARRAY: tensor, "dtype": str(obj.dtype)}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {k: encode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(encode(v) for v in obj)
    return obj


def decode(obj: Any) -> Any:
    """The inverse of `encode`."""
    if isinstance(obj, dict):
        if NDARRAY in obj:
            return obj[NDARRAY].numpy().astype(obj["dtype"], copy=False)
        return {k: decode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(decode(v) for v in obj)
    return obj


def save_state(state: Any, path: str | Path) -> None:
    torch.save(encode(state), path)


def load_state(path: str | Path, map_location: Any = None, mmap: bool = False) -> Any:
    """`torch.load(weights_only=True)`, then `decode`. Refuses (UnsafeCheckpointError) what it cannot load
    safely. mmap: the tensors mapped from the file, read only where they are used (a rank keeping a slice of
    each)."""
    try:
        return decode(torch.load(path, map_location=map_location, weights_only=True, mmap=mmap))
    except FileNotFoundError:
        raise
    except Exception as e:  # the restricted unpickler's refusal, or a file that is not a torch checkpoint
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UnsafeCheckpointError(
            f"{path}: refused to load: it needs more than plain data and tensors to unpickle ({first}); "
            "packtrain never loads checkpoints with weights_only=False. Use a checkpoint written by "
            "packtrain (or load it yourself if you trust where it came from)") from e
