"""Attention kernels: Triton on CUDA, PyTorch everywhere else.

Two operations, each with a PyTorch reference (``reference.py``, the CPU path) and a Triton
kernel (``_triton.py``, imported lazily):

* ``verify_attention(q, k_cache, v_cache, starts, want_rows, scale, max_start)``: the T <= 32 new
  tokens of each row (AR decode T = 1, verification T = K + 1) attend causally to the dense cache
  of a ragged batch; optionally emits the importance rows ``[B, H_kv, W, S]`` float32 of the last W
  queries (attention probabilities summed over the query heads of each KV head).
* ``sparse_attention(q, k_cache, v_cache, index, n_valid, k_tail, v_tail, scale)``: draft queries
  attend to the positions ``index`` ``[B, H_kv, N]`` of the dense cache (gathered inside the
  kernel: no compact copy) plus the draft phase's own tail tokens.

Backend choice (``backend()``): ``SPARSESPEC_ATTENTION=torch|triton|auto`` (default auto = Triton
iff the tensors are on CUDA and triton imports). ``triton`` on a CPU device needs
``TRITON_INTERPRET=1`` set before triton is first imported (the parity tests do this). On the CPU,
auto means the model's kernel plan (``sparsespec.kernels.plan``: our C kernels in ``cpu.py``,
where measured faster); ``torch`` forces the PyTorch references there too.
"""
from __future__ import annotations

import functools
import importlib.util
import os

import torch

from sparsespec.kernels.reference import (
    grouped_attention,
    sparse_attention_ref,
    verify_attention_ref,
    verify_mask,
)

__all__ = [
    "MAX_ROWS", "backend", "grouped_attention", "sparse_attention", "sparse_attention_ref", "triton_available",
    "use_triton", "verify_attention", "verify_attention_ref", "verify_mask",
]

#: largest G * T (query rows of one KV head) the Triton kernels take; larger falls back to torch
MAX_ROWS = 128
_ENV = "SPARSESPEC_ATTENTION"


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when ``import triton`` works (not attempted unless a caller needs the answer)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # pragma: no cover - broken install
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def backend(device: torch.device | str) -> str:
    """``"triton"`` or ``"torch"`` for tensors on ``device`` (see the module docstring).

    Raises:
        ValueError: an unknown ``SPARSESPEC_ATTENTION`` value.
        RuntimeError: ``triton`` forced where it cannot run.
    """
    choice = os.environ.get(_ENV, "auto").strip().lower() or "auto"
    dev = torch.device(device)
    if choice == "torch":
        return "torch"
    if choice == "auto":
        return "triton" if dev.type == "cuda" and triton_available() else "torch"
    if choice == "triton":
        if not triton_available():
            raise RuntimeError(f"{_ENV}=triton but triton is not importable")
        if dev.type != "cuda" and not _interpreting():
            raise RuntimeError(f"{_ENV}=triton on device {dev}: set TRITON_INTERPRET=1 before importing triton")
        return "triton"
    raise ValueError(f"{_ENV} must be torch, triton or auto, got {choice!r}")


def forced_backend() -> str | None:
    """``"torch"`` or ``"triton"`` when ``SPARSESPEC_ATTENTION`` forces one, else None (auto)."""
    choice = os.environ.get(_ENV, "auto").strip().lower() or "auto"
    return None if choice == "auto" else choice


def use_triton(device: torch.device | str) -> bool:
    """True when attention on ``device`` runs the Triton kernels."""
    return backend(device) == "triton"


def _kernels():
    from sparsespec.kernels import _triton

    return _triton


def verify_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, starts: torch.Tensor,
                     want_rows: int, scale: float, max_start: int | None = None, *, use: bool | None = None,
                     rows_out: torch.Tensor | None = None, **launch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Decode/verify attention of a ragged batch with optional importance rows.

    Args:
        q: ``[B, H, T, D]`` bf16/fp16/fp32, the new tokens' queries (after RoPE).
        k_cache, v_cache: ``[B, H_kv, S_max, D]`` (same dtype) one layer's dense cache, any strides,
            the new tokens already written at ``starts[b] .. starts[b] + T - 1``.
        starts: ``[B]`` int, each row's length before this forward (on q's device).
        want_rows: W in ``[0, T]``.
        scale: softmax scale.
        max_start: ``max(starts)`` on the host (saves a sync).
        use: force the Triton (True) or torch (False) path; default ``use_triton(q.device)``.
        rows_out: optional ``[B, H_kv, W, max_start + T]`` float32 buffer (any strides) the rows are
            written into (and returned), e.g. one layer's slice of an ``[L, ...]`` buffer.
        launch: ``num_splits`` / ``block_n`` overrides for the Triton launch (tests).

    Returns:
        out ``[B, H, T, D]`` (q's dtype) and rows ``[B, H_kv, W, max_start + T]`` float32 or None;
        row b's query t attends to positions ``<= starts[b] + t``; rows are zero past it.
        Accumulation in fp32 on both paths.
    """
    if use is None:
        use = use_triton(q.device)
    G, T = q.shape[1] // k_cache.shape[1], q.shape[2]
    if use and G * T <= MAX_ROWS:
        return _kernels().verify_attention_triton(q, k_cache, v_cache, starts, want_rows, scale, max_start,
                                                  rows_out=rows_out, **launch)
    out, rows = verify_attention_ref(q, k_cache, v_cache, starts, want_rows, scale, max_start)
    if rows_out is not None and rows is not None:
        rows_out.copy_(rows)
        rows = rows_out
    return out, rows


def sparse_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index: torch.Tensor,
                     n_valid: torch.Tensor | None, k_tail: torch.Tensor | None, v_tail: torch.Tensor | None,
                     scale: float, *, use: bool | None = None, **launch) -> torch.Tensor:
    """Sparse draft attention over ``index`` of the dense cache plus the draft tail.

    Args:
        q: ``[B, H, T, D]``; query t is tail slot ``E - T + t``.
        k_cache, v_cache: ``[B, H_kv, S_max, D]`` one layer's dense cache.
        index: ``[B, H_kv, N]`` int32/int64 positions (sorted or not; each is read once).
        n_valid: ``[B]`` int, row b uses its first ``n_valid[b]`` index entries; None = all N.
        k_tail, v_tail: ``[B, H_kv, E, D]`` the draft tokens of this phase (E >= T), or None.
        scale: softmax scale.
        use, launch: as in ``verify_attention``.

    Returns:
        out ``[B, H, T, D]`` in q's dtype (fp32 accumulation).
    """
    if use is None:
        use = use_triton(q.device)
    G, T = q.shape[1] // k_cache.shape[1], q.shape[2]
    if use and G * T <= MAX_ROWS:
        return _kernels().sparse_attention_triton(q, k_cache, v_cache, index, n_valid, k_tail, v_tail, scale, **launch)
    return sparse_attention_ref(q, k_cache, v_cache, index, n_valid, k_tail, v_tail, scale)
