"""The one file that imports flash-attn, behind an availability check.

The CPU test suite never needs flash-attn: nothing here imports it at module load, `flash_varlen_args`
is a pure function the tests check, and the real kernel is exercised by tests/test_gpu.py on CUDA.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

FLASH_DTYPES = (torch.float16, torch.bfloat16)
"""flash-attn kernels run in half precision only."""


@functools.lru_cache(maxsize=1)
def _import_flash_attn() -> tuple[ModuleType | None, str | None]:
    """The import point: (module, None) or (None, why the import failed). Tried once per process."""
    try:
        import flash_attn
    except (ImportError, OSError) as err:  # OSError: a wheel built against another CUDA/torch
        return None, f"{type(err).__name__}: {err}"
    return flash_attn, None


def flash_attn_import_error() -> str | None:
    """None if flash-attn imports, else the import error as text."""
    return _import_flash_attn()[1]


def flash_unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the flash backend cannot run on (device, dtype), or None if it can."""
    if device.type != "cuda":
        return f"flash-attn needs a CUDA device, got {device.type!r}"
    error = flash_attn_import_error()
    if error is not None:
        return (f"the flash-attn package does not import ({error}); "
                "install it with `pip install 'packtrain[flash]'`")
    if dtype not in FLASH_DTYPES:
        return f"flash-attn runs in float16/bfloat16 only, got {dtype} (train under bf16 autocast)"
    return None


def flash_varlen_args(
    q_NHD: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int
) -> dict:
    """Keyword arguments for `flash_attn.flash_attn_varlen_func`: document-causal attention over flat tokens.

    q, k, v are (N, H, D) with N the flattened positions of all packed rows; cu_seqlens is (S + 1,) with
    a leading 0 and ending at N. The kernel wants int32 boundaries on the tokens' device and a Python int
    for the longest segment. Example: segments [3, 2] -> cu_seqlens_q = cu_seqlens_k = [0, 3, 5], max 3.
    """
    if not (q_NHD.dim() == 3 and q_NHD.shape == k_NHD.shape == v_NHD.shape):
        raise ValueError(f"q, k, v must share one (N, H, D) shape, got {q_NHD.shape}, {k_NHD.shape}, "
                         f"{v_NHD.shape}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be (S + 1,) with a leading 0, got shape {tuple(cu_seqlens.shape)}")
    cu = cu_seqlens.to(device=q_NHD.device, dtype=torch.int32)
    max_len = int(max_seqlen)
    return dict(
        q=q_NHD,
        k=k_NHD,
        v=v_NHD,
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        max_seqlen_q=max_len,
        max_seqlen_k=max_len,
        causal=True,
    )


def flash_varlen_qk_args(
    q_MHD: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor, cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
) -> dict:
    """`flash_attn_varlen_func` arguments with separate query and key segments (context parallelism's
    allgather strategy: a piece of m queries of a document attends to its n >= m keys up to the last query).
    flash-attn >= 2.1 aligns the causal mask at the bottom right when m < n: query i sees keys 0 .. n - m + i.
    Example: one piece of 2 queries over 5 keys -> cu_seqlens_q [0, 2], cu_seqlens_k [0, 5], max 2 and 5."""
    if not (q_MHD.dim() == k_NHD.dim() == 3 and k_NHD.shape == v_NHD.shape
            and q_MHD.shape[1:] == k_NHD.shape[1:]):
        raise ValueError(f"q (M, H, D) and k, v (N, H, D) expected, got {q_MHD.shape}, {k_NHD.shape}, "
                         f"{v_NHD.shape}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.dim() != 1 or cu_seqlens_q.numel() < 2:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must both be (S + 1,), got "
                         f"{tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_k.shape)}")
    return dict(
        q=q_MHD, k=k_NHD, v=v_NHD,
        cu_seqlens_q=cu_seqlens_q.to(device=q_MHD.device, dtype=torch.int32),
        cu_seqlens_k=cu_seqlens_k.to(device=q_MHD.device, dtype=torch.int32),
        max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k), causal=True,
    )


def _flash_attn() -> ModuleType:
    flash_attn, error = _import_flash_attn()
    if flash_attn is None:
        raise RuntimeError(
            f"attention backend 'flash' needs the flash-attn package, which does not import ({error}); "
            "install it with `pip install 'packtrain[flash]'` on a CUDA machine or pick another backend"
        )
    return flash_attn


def flash_varlen_attention(
    q_NHD: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int
) -> torch.Tensor:
    """flash-attn's varlen kernel; returns (N, H, D).

    Raises RuntimeError naming what is missing if flash-attn does not import. Device and dtype are checked
    by the adapter's backend resolution (`trainer.model.attention.backend_unavailable_reason`).
    """
    return _flash_attn().flash_attn_varlen_func(**flash_varlen_args(q_NHD, k_NHD, v_NHD, cu_seqlens,
                                                                    max_seqlen))


def flash_varlen_attention_qk(
    q_MHD: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor, cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
) -> torch.Tensor:
    """flash-attn's varlen kernel with separate query and key segments (`flash_varlen_qk_args`); (M, H, D)."""
    return _flash_attn().flash_attn_varlen_func(**flash_varlen_qk_args(
        q_MHD, k_NHD, v_NHD, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
