"""Which kernel runs each op of a forward, decided on the machine that runs it.

A ``KernelPlan`` names, for one model on one device:

* ``linear``: the matmul backend per range of rows ``M`` (a decode step has ``B``, a verify
  ``B * (k + 1)``, a prefill chunk hundreds): ``"ss"`` (ours, ``sparsespec.kernels.cpu``: a 6 x 16
  outer-product kernel over a copy of the weight packed in panels of 16 columns), ``"onednn"``
  (PyTorch's oneDNN linear over its own prepacked copy) or ``"mkl"`` (``F.linear``);
* ``attention``: ``"ss"`` (ours: decode/verify with the importance rows, and the sparse draft
  with the index gathered in the kernel), ``"torch"`` (``sparsespec.kernels.reference``) or
  ``"triton"`` (CUDA);
* ``attention_tiles`` / ``linear_tiles``: which tiles our attention and our packed linear run where
  the kernels were built with AVX-512: ``"avx512"`` (16 lanes) or ``"avx2"``, and for the attention
  also ``"avx512-kt"`` (the AVX-512 tiles, with a verify's score phase in keys-in-lanes tiles: 32
  keys transposed once, then GEMM-like tiles of up to 12 query rows without horizontal sums, and
  ``attention_kt_vprefetch``: whether that path fetches a block's value rows early), and with the
  AVX-512 tiles ``attention_pv_prefetch``: how many keys ahead the P.V phase fetches value rows
  (0: none), ``attention_next_kprefetch``: whether a decode step's P.V (and the keys-in-lanes
  path's) fetches the next chunk's keys into L2 and ``attention_verify_kprefetch``: the widest
  verify (query positions) in the row-pair score tiles that does too (0: none), and with any of them
  ``attention_decode_kprefetch``: how many keys ahead a one-token forward's scores fetch keys into
  L2 (0: none); for our packed linear, ``linear_wide_prefetch``: how many rows of a weight panel its
  first row tile fetches ahead where the rows take two or more tiles (a verify's widths); all give
  bitwise the same results, so this is a speed choice only (``""``: not
  applicable);
* ``fused``: RMSNorm, RoPE and SiLU-and-multiply through our kernels (one call each instead of
  four to eight PyTorch ops);
* ``prefill_attention``: a prefill chunk's causal attention (hundreds of queries per row): ``"ss"``
  (ours: flash attention in GEMM tiles, ``cpu.prefill_attention``; AVX-512 or AVX2 tiles) or ``"torch"``
  (PyTorch's fused CPU flash attention, ``sparsespec.kernels.reference.chunk_attention_cpu``; SDPA elsewhere);
* ``threads``: the torch threads it was measured with.

Where none of our kernels can run (a GPU, a dtype other than fp32, no compiler) the plan is the
PyTorch one. On a CPU the default is decided by a short measured trial (``tune``): each linear
backend over the model's own weights at two widths M per range of rows (``LINEAR_RANGES``), each
attention backend at a decode and a verify shape, interleaved, the best of three (where built, our
kernels' AVX-512 and AVX2 tiles, and the attention's keys-in-lanes score tiles, are timed as
backends of their own, and the fastest over all widths is kept), and both prefill attentions on one
512-query chunk; a range goes to the backend whose worst width is fastest (ours kept within
``TIE_MARGIN`` for decode widths). A kernel choice that wins on one CPU can lose 25-30 % on another,
so nothing is assumed: the trial's winner is the default, cached
per CPU (model and ISA flags), torch version, threads, kernel build and model shape in
``$SPARSESPEC_CACHE/tuning/``, so a later load on the same machine reads it (``source="cache"``).

User overrides: ``SPARSESPEC_KERNELS=auto`` (default: measured), ``torch`` (PyTorch's ops
only: the eager reference), ``ss`` (ours wherever they run); ``SPARSESPEC_LINEAR=ss|onednn|mkl``
forces one linear backend for every M; ``SPARSESPEC_PREPACK=0`` leaves oneDNN out of the trial;
``SPARSESPEC_AVX512=0`` keeps our kernels on their AVX2 tiles; ``SPARSESPEC_ATTENTION_KT=N`` runs
the keys-in-lanes score tiles from N query rows per KV head (0: never) whatever the trial measured;
``SPARSESPEC_ATTENTION_PV_PREFETCH=N`` sets the P.V phase's value fetch distance (keys; 0: none);
``SPARSESPEC_ATTENTION_DECODE_KPREFETCH=N`` a one-token forward's far key fetch (keys; 0: none);
``SPARSESPEC_ATTENTION_NEXT_KPREFETCH=1|0`` whether a decode (or keys-in-lanes) P.V fetches the next keys;
``SPARSESPEC_ATTENTION_VERIFY_KPREFETCH=N`` the widest row-pair verify (query positions) whose P.V does too (0: none);
``SPARSESPEC_LINEAR_WIDE_PREFETCH=N`` the packed linear's fetch distance in rows with two or more row tiles;
``SPARSESPEC_PREFILL_ATTENTION=ss|torch`` picks the prefill chunks' attention.
The chosen plan goes into every run's provenance and every bench row (``KernelPlan.describe``).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from sparsespec.kernels import cpu
from sparsespec.kv.cache import KVCache
from sparsespec.kv.index import RowsTarget
from sparsespec.quant import PACKED_ATTR, PANELS_ATTR, Int8Weight, prepack_available

#: linear backends (``KernelPlan.linear``)
LINEAR_BACKENDS = ("ss", "onednn", "mkl")
#: the linear plan's row ranges (upper bound) and the widths the trial times in each. A decode step
#: has B rows, a verify B * (k + 1), a prefill chunk hundreds. Two widths per range: MKL's and
#: oneDNN's speed jumps between neighbouring widths (SmolLM2 on a 2-core Xeon, MKL over every
#: weight: 64 ms at M = 32, 84 ms at M = 36), so a range goes to the backend whose worst width is best.
#: The open range is prefill: 512 is the engine's prefill chunk (at 256 rows our AVX-512 tile ties
#: MKL on the Xeon, at 512 MKL is 7 % faster, and whole prefills 6 % faster)
LINEAR_RANGES: tuple[tuple[int | None, tuple[int, ...]], ...] = (
    (1, (1,)), (8, (4, 8)), (16, (12, 16)), (32, (24, 32)), (64, (36, 64)), (128, (96, 128)), (None, (256, 512)))
TRIAL_ROWS = tuple(m for _, ms in LINEAR_RANGES for m in ms)
#: the linear trials stream the first whole layers that reach this many bytes of fp32 panels at the
#: memory-bound widths (every weight of a smaller model: SmolLM2-135M's 538 MB): far more than a
#: last-level cache, so they come from memory as in a step, in a bounded time for a large model
#: (Qwen2.5-Coder-1.5B: 3 of its 28 layers)
TRIAL_STREAM_BYTES = 512 << 20
RANGE_UPPER = tuple(u for u, _ in LINEAR_RANGES)
#: the forwards of ``_confirm_in_forward``: verifies of k + 1 tokens per row over this many keys, for
#: the ranges up to ``FORWARD_TRIAL_UPTO`` rows (decode and verify widths; in a prefill chunk the
#: per-layer overhead that our fused forward saves is a small share, and the linear trial decides)
FORWARD_TRIAL_K, FORWARD_TRIAL_CONTEXT, FORWARD_TRIAL_UPTO = 8, 256, 128
_KERNELS_ENV, _LINEAR_ENV, _KT_ENV = "SPARSESPEC_KERNELS", "SPARSESPEC_LINEAR", "SPARSESPEC_ATTENTION_KT"
_PREFILL_ENV, _PV_ENV = "SPARSESPEC_PREFILL_ATTENTION", "SPARSESPEC_ATTENTION_PV_PREFETCH"
_DK_ENV = "SPARSESPEC_ATTENTION_DECODE_KPREFETCH"
_NK_ENV, _VK_ENV = "SPARSESPEC_ATTENTION_NEXT_KPREFETCH", "SPARSESPEC_ATTENTION_VERIFY_KPREFETCH"
_LW_ENV = "SPARSESPEC_LINEAR_WIDE_PREFETCH"
TUNE_VERSION = 20
#: the prefill trial's chunk: ``PREFILL_TRIAL_T`` queries after ``PREFILL_TRIAL_START`` keys (a chunk
#: of the engine's 512 inside a 2K prompt), over ``PREFILL_TRIAL_LAYERS`` layers' caches
PREFILL_TRIAL_T, PREFILL_TRIAL_START, PREFILL_TRIAL_LAYERS = 512, 1536, 4
#: another linear backend replaces ours for a range of rows only when the trial measured it faster
#: by more than this (best-of-3 timings on a shared machine move by about this much between runs);
#: one kernel for every decode width keeps a row's logits independent of its batch and k
TIE_MARGIN = 0.05


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """See the module docstring. ``linear``: ``((upper_M or None, backend), ...)`` ascending.

    Raises:
        ValueError: an unknown backend, or ranges not ascending.
    """

    linear: tuple[tuple[int | None, str], ...] = ((None, "mkl"),)
    attention: str = "torch"
    fused: bool = False
    threads: int = 0
    #: "default" (no trial: GPU, non-fp32, kernels unavailable), "measured", "cache", "env", "user"
    source: str = "default"
    tune_s: float = 0.0
    #: what the trial measured: ``{"linear": {M: {backend: s}}, "attention": {shape: {backend: s}}}``
    timings: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False)
    note: str = ""
    #: "avx512" (attention also "avx512-kt") or "avx2" where our kernels have both (module docstring)
    attention_tiles: str = ""
    linear_tiles: str = ""
    #: with ``attention_tiles="avx512-kt"``: the fewest query rows per KV head (G * T) whose scores
    #: run in the keys-in-lanes tiles (measured by the trial; 0 otherwise)
    attention_kt_rows: int = 0
    #: with ``attention_tiles="avx512-kt"``: whether that path fetches each block's value rows into
    #: L2 during its scores (measured by the trial; without those tiles it means nothing)
    attention_kt_vprefetch: bool = True
    #: a prefill chunk's attention: "ss" (ours) or "torch"
    prefill_attention: str = "torch"
    #: with the AVX-512 attention tiles: how many keys ahead the decode / verify P.V fetches value
    #: rows (``cpu.PV_PREFETCH_KEYS`` or 0, measured by the trial; without those tiles it means nothing)
    attention_pv_prefetch: int = cpu.PV_PREFETCH_KEYS
    #: with our attention: how many keys ahead a one-token forward (decode, the sparse draft) fetches
    #: keys into L2 (``cpu.DECODE_KPREFETCH_KEYS`` or 0, measured by the trial)
    attention_decode_kprefetch: int = cpu.DECODE_KPREFETCH_KEYS
    #: with the AVX-512 attention tiles: whether a decode step's P.V (and the keys-in-lanes path's)
    #: fetches the next chunk's keys into L2 (measured by the fetch trial, the keys-in-lanes
    #: variants timed with it on; without those tiles it means nothing)
    attention_next_kprefetch: bool = True
    #: with the AVX-512 attention tiles and the fetch above: the widest verify (query positions) in
    #: the row-pair score tiles whose P.V fetches the next chunk's keys too (``cpu.VERIFY_KPREFETCH_T``
    #: or 0, measured by the fetch trial at that width)
    attention_verify_kprefetch: int = cpu.VERIFY_KPREFETCH_T
    #: with our packed linear: how many rows of a weight panel the first row tile fetches ahead where
    #: the rows take two or more tiles (``cpu.LINEAR_WIDE_PREFETCH_ROWS`` or ``..._FAR``, measured by
    #: the linear fetch trial, ``_linear_fetch_trial``)
    linear_wide_prefetch: int = cpu.LINEAR_WIDE_PREFETCH_ROWS

    def __post_init__(self) -> None:
        uppers = [u for u, _ in self.linear]
        if not self.linear or uppers[-1] is not None or any(u is None for u in uppers[:-1]) \
                or uppers[:-1] != sorted(uppers[:-1]):
            raise ValueError(f"linear ranges must ascend and end with None, got {self.linear}")
        for _, be in self.linear:
            if be not in LINEAR_BACKENDS:
                raise ValueError(f"linear backend must be one of {LINEAR_BACKENDS}, got {be!r}")
        if self.attention not in ("ss", "torch", "triton"):
            raise ValueError(f"attention must be ss, torch or triton, got {self.attention!r}")
        if self.attention_tiles not in ("", "avx512-kt", "avx512", "avx2"):
            raise ValueError(f"attention_tiles must be avx512-kt, avx512, avx2 or empty, got {self.attention_tiles!r}")
        if self.linear_tiles not in ("", "avx512", "avx2"):
            raise ValueError(f"linear_tiles must be avx512, avx2 or empty, got {self.linear_tiles!r}")
        if self.prefill_attention not in ("ss", "torch"):
            raise ValueError(f"prefill_attention must be ss or torch, got {self.prefill_attention!r}")
        for name in ("attention_pv_prefetch", "attention_decode_kprefetch", "attention_verify_kprefetch"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= cpu.CHUNK:
                raise ValueError(f"{name} must be an integer in [0, {cpu.CHUNK}], got {v!r}")
        v = self.linear_wide_prefetch
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= cpu.LINEAR_PREFETCH_MAX:
            raise ValueError(f"linear_wide_prefetch must be an integer in [0, {cpu.LINEAR_PREFETCH_MAX}], got {v!r}")
        if not isinstance(self.attention_next_kprefetch, bool):
            raise ValueError(f"attention_next_kprefetch must be a bool, got {self.attention_next_kprefetch!r}")
        if (self.attention_kt_rows > 0) != (self.attention_tiles == "avx512-kt") or self.attention_kt_rows < 0:
            raise ValueError(f"attention_kt_rows must be > 0 exactly with attention_tiles='avx512-kt', got "
                             f"{self.attention_kt_rows} with {self.attention_tiles!r}")

    # ------------------------------------------------------------------ queries
    def linear_backend(self, rows: int) -> str:
        for upper, be in self.linear:
            if upper is None or rows <= upper:
                return be
        return self.linear[-1][1]  # pragma: no cover - the last range is open

    @property
    def uses_onednn(self) -> bool:
        return any(be == "onednn" for _, be in self.linear)

    @property
    def uses_panels(self) -> bool:
        return any(be == "ss" for _, be in self.linear)

    @property
    def batch_invariant(self) -> bool:
        """True when every decode-width linear (M <= 128) and the attention are our kernels: a row's
        logits then do not depend on the batch or on the number of queries of the step."""
        return self.attention == "ss" and {self.linear_backend(m) for m in range(1, 129)} == {"ss"}

    def describe(self) -> dict[str, Any]:
        """The plan as plain data (provenance, bench rows): backends, where it came from, the CPU."""
        return {"linear": {("inf" if u is None else str(u)): be for u, be in self.linear},
                "attention": self.attention, "attention_tiles": self.attention_tiles or None,
                "attention_kt_rows": self.attention_kt_rows or None,
                "attention_kt_vprefetch": self.attention_kt_vprefetch if self.attention_kt_rows else None,
                "attention_pv_prefetch": self.attention_pv_prefetch if self._pv_tiles else None,
                "attention_next_kprefetch": self.attention_next_kprefetch if self._pv_tiles else None,
                "attention_verify_kprefetch": self.attention_verify_kprefetch if self._pv_tiles else None,
                "attention_decode_kprefetch": self.attention_decode_kprefetch if self.attention == "ss" else None,
                "linear_tiles": self.linear_tiles or None,
                "linear_wide_prefetch": self.linear_wide_prefetch if self.uses_panels else None,
                "prefill_attention": self.prefill_attention,
                "fused": self.fused, "threads": self.threads,
                "source": self.source, "tune_s": round(self.tune_s, 3), "batch_invariant": self.batch_invariant,
                "cpu": cpu.cpu_model(), "isa": cpu.isa_summary(),
                "kernels_build_s": cpu.build_seconds() if (self.attention == "ss" or self.fused) else None,
                "read_bytes_per_s": self.timings.get("read_bytes_per_s"), "note": self.note}

    @property
    def _pv_tiles(self) -> bool:
        """Whether ``attention_pv_prefetch``, ``attention_next_kprefetch`` and
        ``attention_verify_kprefetch`` apply: our attention on its AVX-512 tiles."""
        return self.attention == "ss" and self.attention_tiles.startswith("avx512")

    def summary(self) -> str:
        """One line: e.g. ``linear ss<=8 mkl>8, attention ss, fused (measured, 4.2 s)``."""
        lin = " ".join(f"{be}{'' if u is None else '<=' + str(u)}" for u, be in self.linear)
        if self.uses_panels:
            far = self.linear_wide_prefetch != cpu.LINEAR_WIDE_PREFETCH_ROWS
            notes = [self.linear_tiles] + ([f"wide rows fetch {self.linear_wide_prefetch} ahead"] if far else [])
            lin += f" ({', '.join(n for n in notes if n)})" if any(notes) else ""
        kt = f" from {self.attention_kt_rows} rows" if self.attention_kt_rows else ""
        kt += "" if self.attention_kt_vprefetch or not self.attention_kt_rows else ", values fetched late"
        kt += ", P.V fetches nothing ahead" if self._pv_tiles and not self.attention_pv_prefetch else ""
        kt += ", decode fetches no next keys" if self._pv_tiles and not self.attention_next_kprefetch else ""
        kt += ", verify fetches no next keys" if self._pv_tiles and self.attention_next_kprefetch and \
            not self.attention_verify_kprefetch else ""
        kt += ", decode fetches no keys far ahead" if self.attention == "ss" and not self.attention_decode_kprefetch \
            else ""
        tiles = f" ({self.attention_tiles}{kt})" if self.attention_tiles else ""
        return (f"linear {lin}, attention {self.attention}{tiles}, prefill {self.prefill_attention}"
                f"{', fused' if self.fused else ''}, "
                f"{self.threads} threads ({self.source}{f', {self.tune_s:.1f} s' if self.tune_s else ''})")

    # ------------------------------------------------------------------ the linear op
    def apply_linear(self, x: torch.Tensor, w: torch.Tensor | Int8Weight, bias: torch.Tensor | None = None,
                     residual: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ w.T (+ bias)``; with ``residual`` (same shape as the output), ``residual += that``
        in place and returned (the residual add fused into our kernel)."""
        if isinstance(w, Int8Weight):
            y = w.linear(x, bias)
            return y if residual is None else residual.add_(y)
        be = "mkl"
        if x.device.type == "cpu" and x.dtype == w.dtype:
            be = self.linear_backend(x.numel() // x.shape[-1])
        if be == "ss" and cpu.supports(x):
            panels = getattr(w, PANELS_ATTR, None)
            if panels is not None:
                return cpu.linear_packed(x, panels, w.shape[0], bias, out=residual, accumulate=residual is not None)
            return cpu.linear(x, w, bias, out=residual, accumulate=residual is not None)
        packed = getattr(w, PACKED_ATTR, None) if be == "onednn" else None
        if packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        else:
            y = F.linear(x, w, bias)
        return y if residual is None else residual.add_(y)


def torch_plan(note: str = "", source: str = "default", device: str = "cpu") -> KernelPlan:
    """PyTorch's ops only (the eager reference); Triton attention on CUDA where it runs."""
    from sparsespec import kernels

    att = "triton" if kernels.use_triton(device) else "torch"
    return KernelPlan(((None, "mkl"),), att, False, torch.get_num_threads(), source, note=note)


def ours_plan(source: str = "default", note: str = "") -> KernelPlan:
    """Our kernels wherever they run (decode widths and the prefill attention), MKL for prefill
    chunks' linears."""
    return KernelPlan(((128, "ss"), (None, "mkl")), "ss", True, torch.get_num_threads(), source, note=note,
                      prefill_attention=_prefill_default())


def _prefill_default() -> str:
    return "ss" if cpu.prefill_attention_supported(16) else "torch"


def _eligible(model) -> str | None:
    """None when our CPU kernels can run this model, else why not."""
    if model.device.type != "cpu":
        return f"device {model.device.type}"
    if model.dtype != torch.float32:
        return f"dtype {str(model.dtype).replace('torch.', '')} (our CPU kernels are fp32)"
    if not cpu.available():
        return f"CPU kernels unavailable: {cpu.unavailable_reason()}"
    if model.cfg.hidden_size % 8 or not cpu.attention_supported(model.cfg.head_dim):
        return f"shape (hidden {model.cfg.hidden_size}, head_dim {model.cfg.head_dim}) not supported"
    return None


def choose(model, tune: bool = True, *, progress: Callable[[str], None] | None = None) -> KernelPlan:
    """The plan for ``model`` (see the module docstring): the environment's override, else the
    cached trial for this machine, else a new trial (``tune``) or, with ``tune=False``, ours
    wherever they run.

    Raises:
        ValueError: an unknown ``SPARSESPEC_KERNELS`` or ``SPARSESPEC_LINEAR`` value.
    """
    mode = os.environ.get(_KERNELS_ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "torch", "ss"):
        raise ValueError(f"{_KERNELS_ENV} must be auto, torch or ss, got {mode!r}")
    forced = os.environ.get(_LINEAR_ENV, "").strip().lower()
    if forced and forced not in LINEAR_BACKENDS:
        raise ValueError(f"{_LINEAR_ENV} must be one of {LINEAR_BACKENDS}, got {forced!r}")
    why = _eligible(model)
    if mode == "torch" or why is not None:
        plan = torch_plan(why or f"{_KERNELS_ENV}=torch", "env" if mode == "torch" else "default", model.device)
    elif mode == "ss":
        plan = ours_plan("env", f"{_KERNELS_ENV}=ss")
    elif not tune:
        plan = ours_plan()
    else:
        plan = tune_plan(model, progress=progress)
    if forced:
        if forced == "ss" and why is not None:
            raise ValueError(f"{_LINEAR_ENV}={forced}: {why}")
        plan = dataclasses.replace(plan, linear=((None, forced),), source="env", note=f"{_LINEAR_ENV}={forced}")
    return apply_tiles(plan)


def apply_tiles(plan: KernelPlan) -> KernelPlan:
    """Switch our kernels to the plan's tiles (process-wide: the tiles give bitwise the same
    results, so models sharing the process are unaffected but for speed); a plan without a choice
    gets the library's current one; a plan that does not run our attention / packed linear gets
    "". ``SPARSESPEC_AVX512=0`` and ``SPARSESPEC_ATTENTION_KT`` win over the plan.

    ``SPARSESPEC_PREFILL_ATTENTION=ss|torch`` sets the prefill chunks' attention (``ss`` where our
    kernels cannot run it is an error); a plan's ``ss`` becomes ``torch`` where ours cannot run
    (no kernels, a head size that is not a multiple of 16, PyTorch's attention).

    Raises:
        ValueError: ``SPARSESPEC_ATTENTION_KT`` is not a non-negative integer;
            ``SPARSESPEC_ATTENTION_PV_PREFETCH`` or ``SPARSESPEC_ATTENTION_DECODE_KPREFETCH`` is not
            an integer in ``[0, cpu.CHUNK]``; ``SPARSESPEC_ATTENTION_NEXT_KPREFETCH`` is not 0 or 1;
            ``SPARSESPEC_ATTENTION_VERIFY_KPREFETCH`` is not an integer in ``[0, cpu.CHUNK]``;
            ``SPARSESPEC_PREFILL_ATTENTION`` is not ss or torch, or ss where it cannot run.
    """
    prefill = plan.prefill_attention
    env = os.environ.get(_PREFILL_ENV, "").strip().lower()
    if env:
        if env not in ("ss", "torch"):
            raise ValueError(f"{_PREFILL_ENV} must be ss or torch, got {env!r}")
        if env == "ss" and not (plan.attention == "ss" and cpu.prefill_attention_supported(16)):
            raise ValueError(f"{_PREFILL_ENV}=ss: our prefill attention does not run here "
                             f"(it needs our kernels and attention, and head_dim % 16 == 0)")
        prefill = env
    elif prefill == "ss" and not (plan.attention == "ss" and cpu.prefill_attention_supported(16)):
        prefill = "torch"  # e.g. a cached plan read with SPARSESPEC_KERNELS=torch: say what runs
    if prefill != plan.prefill_attention or env:  # the user's choice is the provenance, even where it is the default
        plan = dataclasses.replace(plan, prefill_attention=prefill, **(
            {"source": "env", "note": (plan.note + "; " if plan.note else "") + f"{_PREFILL_ENV}={env}"} if env else {}))
    att = lin = ""
    if plan.attention == "ss":
        want = plan.attention_tiles or cpu.attention_isa() or ""
        if want:  # a plan without a choice keeps the library's keys-in-lanes rows
            rows = plan.attention_kt_rows if plan.attention_tiles else cpu.attention_kt_rows()
            env = os.environ.get(_KT_ENV, "").strip()
            if env:
                if not env.isdigit():
                    raise ValueError(f"{_KT_ENV}={env!r}: expected the fewest query rows per KV head "
                                     f"for the keys-in-lanes score tiles (0: never)")
                rows = int(env)
                want = "avx2" if want == "avx2" else ("avx512-kt" if rows else "avx512")
            cpu.set_attention_kt(rows)
            cpu.set_attention_kt_vprefetch(plan.attention_kt_vprefetch if plan.attention_tiles else
                                           cpu.attention_kt_vprefetch())
            pv = _env_keys(_PV_ENV, "the P.V phase fetches value rows",
                           plan.attention_pv_prefetch if plan.attention_tiles else cpu.attention_pv_prefetch())
            cpu.set_attention_pv_prefetch(pv)
            cpu.set_attention_next_kprefetch(_env_switch(_NK_ENV, "the P.V fetches the next chunk's keys",
                                                         plan.attention_next_kprefetch if plan.attention_tiles else
                                                         cpu.attention_next_kprefetch()))
            cpu.set_attention_verify_kprefetch(_env_keys(
                _VK_ENV, "fetches the next chunk's keys", plan.attention_verify_kprefetch if plan.attention_tiles
                else cpu.attention_verify_kprefetch(), expect="the widest verify (query positions) whose P.V"))
        dk = _env_keys(_DK_ENV, "a one-token forward fetches keys into L2", plan.attention_decode_kprefetch)
        cpu.set_attention_decode_kprefetch(dk)
        att = (cpu.set_attention_avx512(want != "avx2") or "") if want else ""
    lw = plan.linear_wide_prefetch
    if plan.uses_panels:
        want = plan.linear_tiles or cpu.linear_isa() or ""
        lin = (cpu.set_linear_avx512(want == "avx512") or "") if want else ""
        lw = _env_keys(_LW_ENV, "the packed linear's first row tile fetches (with two tiles or more)", lw,
                       expect="how many weight rows ahead", upper=cpu.LINEAR_PREFETCH_MAX)
        lw = cpu.set_linear_wide_prefetch(lw) if cpu.available() else lw
    kt_rows = cpu.attention_kt_rows() if att == "avx512-kt" else 0
    vpf = cpu.attention_kt_vprefetch() if kt_rows else plan.attention_kt_vprefetch  # without kt tiles: moot
    pv = cpu.attention_pv_prefetch() if att.startswith("avx512") else plan.attention_pv_prefetch  # likewise
    nk = cpu.attention_next_kprefetch() if att.startswith("avx512") else plan.attention_next_kprefetch
    vk = cpu.attention_verify_kprefetch() if att.startswith("avx512") else plan.attention_verify_kprefetch
    dk = cpu.attention_decode_kprefetch() if plan.attention == "ss" else plan.attention_decode_kprefetch
    if (att, lin, kt_rows, vpf, pv, dk, nk, vk, lw) == (
            plan.attention_tiles, plan.linear_tiles, plan.attention_kt_rows, plan.attention_kt_vprefetch,
            plan.attention_pv_prefetch, plan.attention_decode_kprefetch, plan.attention_next_kprefetch,
            plan.attention_verify_kprefetch, plan.linear_wide_prefetch):
        return plan
    return dataclasses.replace(plan, attention_tiles=att, linear_tiles=lin, attention_kt_rows=kt_rows,
                               attention_kt_vprefetch=vpf, attention_pv_prefetch=pv, attention_decode_kprefetch=dk,
                               attention_next_kprefetch=nk, attention_verify_kprefetch=vk, linear_wide_prefetch=lw)


def _env_keys(name: str, what: str, default: int, expect: str = "how many keys ahead", upper: int = cpu.CHUNK) -> int:
    """A fetch distance in keys (or, as ``expect`` says, a verify width or weight rows) from the
    environment variable ``name`` (digits, at most ``upper``), else ``default``.

    Raises:
        ValueError: the variable is set to anything else.
    """
    env = os.environ.get(name, "").strip()
    if not env:
        return default
    if not env.isdigit() or int(env) > upper:
        raise ValueError(f"{name}={env!r}: expected {expect} {what}, 0 to {upper} (0: none)")
    return int(env)


def _env_switch(name: str, what: str, default: bool) -> bool:
    """A kernel switch from the environment variable ``name`` (``1``: on, ``0``: off), else ``default``.

    Raises:
        ValueError: the variable is set to anything else.
    """
    env = os.environ.get(name, "").strip()
    if not env:
        return default
    if env not in ("0", "1"):
        raise ValueError(f"{name}={env!r}: expected 1 (on) or 0 (off): whether {what}")
    return env == "1"


# --------------------------------------------------------------------------- the trial
def _cache_path(model, threads: int) -> Path:
    cfg = model.cfg
    shape = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers, cfg.num_heads,
             cfg.num_kv_heads, cfg.head_dim, cfg.tie_word_embeddings, cfg.attention_bias, str(model.dtype))
    key = json.dumps([TUNE_VERSION, cpu.cpu_model(), " ".join(cpu.cpu_flags()), torch.__version__, threads,
                      Path(cpu.library_path() or "").name, prepack_available(), shape])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cpu.cache_dir().parent / "tuning" / f"plan-{digest}.json"


def _weights(model) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    out = []
    for layer in model.layers:
        out += [(layer.wqkv, layer.bqkv), (layer.wo, None), (layer.w_gate_up, None), (layer.w_down, None)]
    out.append((model.lm_head, None))
    return [(w, b) for w, b in out if not isinstance(w, Int8Weight)]


def _first_layers(weights: list[tuple[torch.Tensor, torch.Tensor | None]], enough: Callable[[int], bool]):
    """``_weights``' list cut after the first whole layer (its four projections) at which
    ``enough(numel so far)`` holds; every weight (the LM head too) where no prefix of layers is
    enough. The trials time this share of a large model: the layers all have one shape."""
    acc = 0
    for i in range(0, len(weights) - 1, 4):
        acc += sum(w.numel() for w, _ in weights[i : i + 4])
        if enough(acc):
            return weights[: i + 4]
    return weights


def _interleaved(fns: Mapping[str, Callable[[], Any]], reps: int) -> dict[str, list[float]]:
    """Seconds of each function per round after a warm-up round, ``reps`` rounds, the order
    reversed every other round (neither order favoured)."""
    for f in fns.values():
        f()
    times: dict[str, list[float]] = {name: [] for name in fns}
    items = list(fns.items())
    for r in range(reps):
        for name, f in (items if r % 2 == 0 else items[::-1]):
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    return times


def _best_of(fns: Mapping[str, Callable[[], Any]], reps: int) -> dict[str, float]:
    """Min seconds of each function over ``_interleaved``'s rounds (drift hits all alike)."""
    return {name: min(ts) for name, ts in _interleaved(fns, reps).items()}


def _linear_trial(model, backends: list[str], reps: int) -> dict[int, dict[str, float]]:
    weights = _weights(model)
    total = sum(w.numel() for w, _ in weights)
    # decode widths (memory-bound): every weight, so they come from memory as in a step; wide rows
    # (compute-bound, cache residency does not matter), and every width of a model of more than
    # ~1 G parameters: whole layers up to ~1 GFLOP or TRIAL_STREAM_BYTES, whichever comes first
    sels = {m: weights if 2 * m * total <= 2e9 else
            _first_layers(weights, lambda n, m=m: 2 * m * n >= 1e9 or 4 * n >= TRIAL_STREAM_BYTES)
            for m in TRIAL_ROWS}
    used = max(sels.values(), key=len)  # each selection is a prefix of ``weights``
    # the copies of the weights some width runs, only (Qwen2.5-Coder-1.5B: 2 of its 7 GB, twice)
    packed = {}
    if "onednn" in backends:
        packed = {id(w): w.detach().contiguous().to_mkldnn() for w, _ in used}
    panels = {id(w): cpu.pack_weight(w) for w, _ in used} if "ss" in backends else {}
    res: dict[int, dict[str, float]] = {}
    for m in TRIAL_ROWS:
        sel = sels[m]
        xs = {k: torch.randn(m, k, dtype=model.dtype) for k in {w.shape[1] for w, _ in sel}}

        def run(be: str, sel=sel, xs=xs):
            for w, b in sel:
                x = xs[w.shape[1]]
                if be in ("ss", "ss-avx2"):
                    cpu.linear_packed(x, panels[id(w)], w.shape[0], b)
                elif be == "onednn":
                    torch.ops.mkldnn._linear_pointwise(x, packed[id(w)], b, "none", [], "")
                else:
                    F.linear(x, w, b)

        def run_avx2(run=run):  # our AVX2 tile (the same results as the AVX-512 one)
            cpu.set_linear_avx512(False)
            try:
                run("ss")
            finally:
                cpu.set_linear_avx512(True)

        with torch.inference_mode():
            res[m] = _best_of({be: (run_avx2 if be == "ss-avx2" else (lambda be=be: run(be))) for be in backends}, reps)
    return res


#: verify widths T = k + 1 at which the trial also times the keys-in-lanes score tiles against the
#: AVX-512 ones (they transpose 32 keys per block once, which pays only when enough rows share it)
KT_TRIAL_T = (1, 3, 5, 9, 17)
#: the fetch trial (``_fetch_trial``): rows of a decode step and of a k = 2 verify whose caches
#: stream from memory, and its interleaved reps (its choices move the time by a few percent, where a
#: best of three at batch 1 flipped from run to run on the AMD EPYC of benchmarks/RESULTS.md)
FETCH_TRIAL_BATCH, FETCH_TRIAL_REPS = 4, 9
#: the fetch trial's verify width (k = 2: the k ``k="auto"`` picks most where it drafts)
FETCH_TRIAL_VERIFY_T = cpu.VERIFY_KPREFETCH_T
#: the attention trial's entry holding the fetch trial (not a width: no ``T``)
FETCH_TRIAL_KEY = "fetch"


def linear_fetch_widths(tile_rows: int) -> tuple[int, int]:
    """The linear fetch trial's widths for a packed linear tile of ``tile_rows`` rows: two of the
    widths that take two row tiles (6-row AVX2 tiles: M = 8, a batch-8 decode, and 12, a batch-4
    k = 2 verify; the far fetch measured 0.89x and 0.97x of the time there on the AMD EPYC without
    AVX-512, and 0.96-1.02x from 16 rows up, where the tiles are bound by their arithmetic)."""
    return tile_rows + 2, 2 * tile_rows


def _linear_fetch_trial(model, reps: int = FETCH_TRIAL_REPS) -> dict[str, float]:
    """The packed linears of ``model`` (its own weights: every one, or its first whole layers of at
    least ``TRIAL_STREAM_BYTES``; streamed from memory as in a step) at the
    ``linear_fetch_widths`` of the tiles in use, with the first row tile fetching
    ``cpu.LINEAR_WIDE_PREFETCH_ROWS`` rows of a panel ahead (``M<m>:near``) and
    ``cpu.LINEAR_WIDE_PREFETCH_FAR`` (``M<m>:far``), ``reps`` rounds of all four, the order reversed
    every other round. Returns each variant's median seconds and under ``M<m>:far/near`` the median
    of its per-round time ratios (a drift between rounds cancels). Leaves the setting at
    ``cpu.LINEAR_WIDE_PREFETCH_ROWS``."""
    sel = _first_layers(_weights(model), lambda n: 4 * n >= TRIAL_STREAM_BYTES)  # fp32 panels
    weights = [(cpu.pack_weight(w), w.shape[0], w.shape[1], b) for w, b in sel]
    fns: dict[str, Callable[[], Any]] = {}
    for m in linear_fetch_widths(cpu.LINEAR_TILE_ROWS.get(cpu.linear_isa() or "avx2", 6)):
        xs = {k: torch.randn(m, k, dtype=model.dtype) for k in {k for _, _, k, _ in weights}}

        def run(xs=xs) -> None:
            for wp, n, k, b in weights:
                cpu.linear_packed(xs[k], wp, n, b)
        fns[f"M{m}:near"] = run
        fns[f"M{m}:far"] = _with_setting(run, cpu.set_linear_wide_prefetch, cpu.LINEAR_WIDE_PREFETCH_FAR,
                                         cpu.LINEAR_WIDE_PREFETCH_ROWS)
    cpu.set_linear_wide_prefetch(cpu.LINEAR_WIDE_PREFETCH_ROWS)
    with torch.inference_mode():
        times = _interleaved(fns, reps)
    out = {name: statistics.median(ts) for name, ts in times.items()}
    for name in fns:
        if name.endswith(":far"):
            near = times[name.replace(":far", ":near")]
            out[f"{name}/near"] = statistics.median(t / b for t, b in zip(times[name], near))
    return out


def linear_wide_prefetch_from_trial(fetch: Mapping[str, float]) -> int:
    """``cpu.LINEAR_WIDE_PREFETCH_FAR`` where the linear fetch trial (``_linear_fetch_trial``'s
    result) measured the far fetch faster, by the geometric mean of its widths' median time ratios
    (``M<m>:far/near``); else ``cpu.LINEAR_WIDE_PREFETCH_ROWS`` (also where it was not timed)."""
    ratios = [r for name, r in fetch.items() if name.endswith(":far/near")]
    return cpu.LINEAR_WIDE_PREFETCH_FAR if ratios and math.prod(ratios) < 1.0 else cpu.LINEAR_WIDE_PREFETCH_ROWS


def _attention_trial(model, reps: int, context: int = 2048, k: int = 8) -> dict[str, dict[str, float]]:
    """Our attention against the PyTorch path at batch 1, a decode (T = 1) and a verify (T = k + 1,
    with its importance rows), over every layer's cache of ``context`` keys. Where built with
    AVX-512, our AVX2 tiles (``ss-avx2``) at those two widths, and the keys-in-lanes score tiles
    (``ss-kt``; ``ss-kt-late``: fetching the value rows late) against the AVX-512 ones (``ss``) at
    every width of ``KT_TRIAL_T``; and under ``FETCH_TRIAL_KEY`` the fetch trial (``_fetch_trial``)."""
    from sparsespec.kernels.reference import grouped_attention

    cfg = model.cfg
    L, Hkv, H, D = cfg.num_layers, cfg.num_kv_heads, cfg.num_heads, cfg.head_dim
    g = torch.Generator().manual_seed(0)
    both_tiles = (cpu.set_attention_avx512(True) or "").startswith("avx512")
    widths = sorted({1, k + 1} | (set(KT_TRIAL_T) if both_tiles else set()))
    kc = torch.randn(L, 1, Hkv, context + max(widths), D, generator=g, dtype=model.dtype)
    vc = torch.randn(L, 1, Hkv, context + max(widths), D, generator=g, dtype=model.dtype)
    starts = torch.tensor([context])
    res = {}
    cpu.set_attention_kt(0)
    cpu.set_attention_pv_prefetch(cpu.PV_PREFETCH_KEYS)
    cpu.set_attention_decode_kprefetch(cpu.DECODE_KPREFETCH_KEYS)
    cpu.set_attention_next_kprefetch(True)
    cpu.set_attention_verify_kprefetch(cpu.VERIFY_KPREFETCH_T)
    with torch.inference_mode():
        for T in widths:
            q = torch.randn(1, H, T, D, generator=g, dtype=model.dtype)
            W = 0 if T == 1 else T
            rows = torch.empty(1, Hkv, W, context + T) if W else None
            mask = None if T == 1 else torch.arange(context + T)[None, None, context:] <= (context + torch.arange(T))[None, :, None]

            def ours(q=q, rows=rows, T=T):
                for i in range(L):
                    cpu.attention(q, kc[i], vc[i], starts, context, model.scale, rows)

            def ref(q=q, mask=mask, W=W, T=T):
                for i in range(L):
                    out, _ = grouped_attention(q, kc[i, :, :, : context + T], vc[i, :, :, : context + T], mask, W,
                                               model.scale, mask_from=context)
                    out.transpose(1, 2).reshape(1, T, -1)

            fns: dict[str, Callable[[], Any]] = {"ss": ours}
            if T in (1, k + 1):
                fns["torch"] = ref
                if both_tiles:  # our AVX2 tiles against the AVX-512 ones (the same results)
                    def ours_avx2(ours=ours):
                        cpu.set_attention_avx512(False)
                        try:
                            ours()
                        finally:
                            cpu.set_attention_avx512(True)
                    fns["ss-avx2"] = ours_avx2
            if both_tiles:  # the keys-in-lanes score tiles for every row count (the same results), with
                # the value rows fetched early (ss-kt) and late (ss-kt-late)
                def ours_kt(ours=ours, early=True):
                    cpu.set_attention_kt(1)
                    cpu.set_attention_kt_vprefetch(early)
                    try:
                        ours()
                    finally:
                        cpu.set_attention_kt(0)
                        cpu.set_attention_kt_vprefetch(True)
                fns["ss-kt"] = ours_kt
                fns["ss-kt-late"] = lambda ours_kt=ours_kt: ours_kt(early=False)
            res[f"T{T}"] = _best_of(fns, reps)
    res[FETCH_TRIAL_KEY] = _fetch_trial(model, context, both_tiles)
    return res


def _fetch_trial(model, context: int, both_tiles: bool, batch: int = FETCH_TRIAL_BATCH,
                 reps: int = FETCH_TRIAL_REPS, verify_t: int = FETCH_TRIAL_VERIFY_T) -> dict[str, float]:
    """The attention of a decode step and of a verify (``verify_t`` queries per row, with its
    importance rows), ``batch`` rows of ``context`` keys over every layer's own cache (streamed from
    memory as in a step), with the fetches as they are (``ss``) and each switched off alone: at the
    decode, the far key fetch into L2 (``ss-dk-off``) and, on the AVX-512 tiles, the P.V's fetch of
    the next chunk's keys (``ss-nk-off``) and of the value rows ahead (``ss-pv-off``); at the verify
    (names prefixed ``T<verify_t>:``), the latter two (the next keys: the verify's own switch,
    ``cpu.set_attention_verify_kprefetch``). ``reps`` rounds, every variant in each, the order
    reversed every other round. Returns each variant's median seconds and, under
    ``"<variant>/ss"``, the median of its per-round time ratios to its width's ``ss`` (the
    decisions read those: a drift between rounds cancels)."""
    cfg = model.cfg
    L, Hkv, H, D = cfg.num_layers, cfg.num_kv_heads, cfg.num_heads, cfg.head_dim
    g = torch.Generator().manual_seed(1)
    kc = torch.randn(L, batch, Hkv, context + verify_t, D, generator=g, dtype=model.dtype)
    vc = torch.randn(L, batch, Hkv, context + verify_t, D, generator=g, dtype=model.dtype)
    starts = torch.full((batch,), context, dtype=torch.int64)

    def width(T: int) -> Callable[[], None]:
        q = torch.randn(batch, H, T, D, generator=g, dtype=model.dtype)
        rows = torch.empty(batch, Hkv, T, context + T) if T > 1 else None

        def run() -> None:
            for i in range(L):
                cpu.attention(q, kc[i], vc[i], starts, context, model.scale, rows)
        return run

    ours = width(1)
    fns: dict[str, Callable[[], Any]] = {
        "ss": ours,
        "ss-dk-off": _with_setting(ours, cpu.set_attention_decode_kprefetch, 0, cpu.DECODE_KPREFETCH_KEYS)}
    if both_tiles:
        fns["ss-nk-off"] = _with_setting(ours, cpu.set_attention_next_kprefetch, False, True)
        fns["ss-pv-off"] = _with_setting(ours, cpu.set_attention_pv_prefetch, 0, cpu.PV_PREFETCH_KEYS)
        verify = width(verify_t)
        fns[f"T{verify_t}:ss"] = verify
        fns[f"T{verify_t}:ss-pv-off"] = _with_setting(verify, cpu.set_attention_pv_prefetch, 0,
                                                      cpu.PV_PREFETCH_KEYS)
        fns[f"T{verify_t}:ss-nk-off"] = _with_setting(verify, cpu.set_attention_verify_kprefetch, 0,
                                                      cpu.VERIFY_KPREFETCH_T)
    times = _interleaved(fns, reps)
    out = {name: statistics.median(ts) for name, ts in times.items()}
    for name in fns:
        prefix, _, variant = name.rpartition(":")
        if variant != "ss":
            base = times[f"{prefix}:ss" if prefix else "ss"]
            out[f"{name}/ss"] = statistics.median(t / b for t, b in zip(times[name], base))
    return out


def _with_setting(fn: Callable[[], Any], setter: Callable[[Any], Any], value: Any, restore: Any) -> Callable[[], None]:
    """``fn`` run with a kernel switch at ``value``, put back to ``restore`` afterwards (a trial variant)."""
    def run() -> None:
        setter(value)
        try:
            fn()
        finally:
            setter(restore)
    return run


def _prefill_trial(model, reps: int) -> dict[str, float]:
    """Seconds of one prefill chunk's attention (``PREFILL_TRIAL_T`` queries after
    ``PREFILL_TRIAL_START`` keys, batch 1, ``PREFILL_TRIAL_LAYERS`` layers' caches), ours
    (``"ss"``) against PyTorch's flash path (``"torch"``), the best of ``reps``; {} where ours
    does not run."""
    from sparsespec.kernels.reference import chunk_attention_cpu

    cfg = model.cfg
    if not cpu.prefill_attention_supported(cfg.head_dim):
        return {}
    T, P, L = PREFILL_TRIAL_T, PREFILL_TRIAL_START, PREFILL_TRIAL_LAYERS
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(L, 1, cfg.num_kv_heads, P + T, cfg.head_dim, generator=g, dtype=model.dtype)
    vc = torch.randn(L, 1, cfg.num_kv_heads, P + T, cfg.head_dim, generator=g, dtype=model.dtype)
    q = torch.randn(1, cfg.num_heads, T, cfg.head_dim, generator=g, dtype=model.dtype)
    starts = torch.tensor([P])

    def ours():
        for i in range(L):
            cpu.prefill_attention(q, kc[i], vc[i], starts, model.scale)

    def ref():
        for i in range(L):
            chunk_attention_cpu(q, kc[i], vc[i], P, model.scale).transpose(1, 2).reshape(1, T, -1)

    with torch.inference_mode():
        return _best_of({"ss": ours, "torch": ref}, reps)


def kt_rows_from_trial(att: Mapping[str, Mapping[str, float]], group: int, kt: str = "ss-kt") -> int:
    """The fewest query rows per KV head (``group`` x T) from which the keys-in-lanes tiles (timed
    as ``kt``) measured faster than the AVX-512 row-pair ones by more than ``TIE_MARGIN`` at every
    wider trial width; 0 where they did not at the widest. (Without the margin the choice at 51
    rows flipped between fresh tunes on the AMD EPYC of benchmarks/RESULTS.md once the row-pair
    tiles ran as fast there: a coin toss between two paths with the same results.)"""
    widths = sorted(int(s[1:]) for s, v in att.items() if kt in v and "ss" in v)
    rows = 0
    for T in reversed(widths):
        if att[f"T{T}"][kt] * (1.0 + TIE_MARGIN) >= att[f"T{T}"]["ss"]:
            break
        rows = group * T
    return rows


def kt_variant_from_trial(att: Mapping[str, Mapping[str, float]]) -> str:
    """``"ss-kt-late"`` where the keys-in-lanes path with its value rows fetched late measured faster,
    summed over the trial's widths, than with them fetched early; else ``"ss-kt"``."""
    both = [v for v in att.values() if "ss-kt" in v and "ss-kt-late" in v]
    if both and sum(v["ss-kt-late"] for v in both) < sum(v["ss-kt"] for v in both):
        return "ss-kt-late"
    return "ss-kt"


def pv_prefetch_from_trial(att: Mapping[str, Mapping[str, float]]) -> int:
    """0 where the AVX-512 tiles with their P.V fetching nothing ahead measured faster than
    fetching ``cpu.PV_PREFETCH_KEYS`` keys ahead in the fetch trial, by the geometric mean of its
    median time ratios (``ss-pv-off/ss``) at the decode and the verify width (each width a regime
    of its own); else ``cpu.PV_PREFETCH_KEYS`` (also where it was not timed)."""
    ratios = [r for name, r in att.get(FETCH_TRIAL_KEY, {}).items() if name.endswith("ss-pv-off/ss")]
    if ratios and math.prod(ratios) < 1.0:
        return 0
    return cpu.PV_PREFETCH_KEYS


def decode_kprefetch_from_trial(att: Mapping[str, Mapping[str, float]]) -> int:
    """0 where a decode step without its far key fetch measured faster than with it in the fetch
    trial (the median time ratio ``ss-dk-off/ss`` below 1); else ``cpu.DECODE_KPREFETCH_KEYS``
    (also where it was not timed)."""
    v = att.get(FETCH_TRIAL_KEY, {})
    return 0 if v.get("ss-dk-off/ss", 1.0) < 1.0 else cpu.DECODE_KPREFETCH_KEYS


def next_kprefetch_from_trial(att: Mapping[str, Mapping[str, float]]) -> bool:
    """False where a decode step without its fetch of the next chunk's keys measured faster than
    with it in the fetch trial (the median time ratio ``ss-nk-off/ss`` below 1; timed on the
    AVX-512 tiles); else True (also where it was not timed)."""
    return not att.get(FETCH_TRIAL_KEY, {}).get("ss-nk-off/ss", 1.0) < 1.0


def verify_kprefetch_from_trial(att: Mapping[str, Mapping[str, float]]) -> int:
    """0 where a verify of ``FETCH_TRIAL_VERIFY_T`` queries in the row-pair tiles without its fetch of
    the next chunk's keys measured faster than with it in the fetch trial (the median time ratio
    ``T<width>:ss-nk-off/ss`` below 1); else ``cpu.VERIFY_KPREFETCH_T`` (also where it was not timed)."""
    r = att.get(FETCH_TRIAL_KEY, {}).get(f"T{FETCH_TRIAL_VERIFY_T}:ss-nk-off/ss", 1.0)
    return 0 if r < 1.0 else cpu.VERIFY_KPREFETCH_T


def range_worst(lin: Mapping[int, Mapping[str, float]], widths: tuple[int, ...]) -> dict[str, float]:
    """Each backend's worst time over ``widths`` as a multiple of the fastest backend at that width
    (``lin``: seconds per width and backend, as ``_linear_trial`` returns them)."""
    return {be: max(lin[m][be] / min(lin[m].values()) for m in widths) for be in lin[widths[0]]}


def forward_trial_tokens(width: int) -> int:
    """Tokens per row of the forward trial at ``width`` rows: the largest divisor of ``width`` up to
    ``FORWARD_TRIAL_K + 1`` (a verify's k + 1), so that the forward's rows are exactly ``width``."""
    return max(t for t in range(1, FORWARD_TRIAL_K + 2) if width % t == 0)


def _confirm_in_forward(model, choice: list[tuple[int | None, str]], threads: int, reps: int,
                        timer: Callable[[Mapping[str, Callable[[], Any]], int], dict[str, float]] = _best_of):
    """Check each range the linear trial gave to a library against ours in whole forwards.

    With ours for a width, a forward runs every layer in one call of our kernels
    (``cpu.forward_layers``); with a library it runs the per-layer Python path. A linear-only trial
    misses that difference (SmolLM2 on a 2-core Xeon: MKL won the linears at M = 36, and the
    verify at batch 4 x k = 8 then ran 10 % slower than with ours). Each such range up to
    ``FORWARD_TRIAL_UPTO`` rows is timed at its widths M, as verifies of ``M / T`` rows of
    ``T = forward_trial_tokens(M)`` tokens over ``FORWARD_TRIAL_CONTEXT`` keys (importance rows
    into a ring, as the engine runs them), under the linear trial's plan and under that plan with
    ours for the range; the library keeps the range only when it is faster at every width by more
    than ``TIE_MARGIN``. Returns the choice and the timings
    (``{"<width>": {"ss"|"<library>": s}}``). Leaves the model's plan as it found it. ``timer``:
    ``_best_of`` (a test passes a fake one)."""
    if all(be == "ss" or upper is None or upper > FORWARD_TRIAL_UPTO for upper, be in choice):
        return list(choice), {}  # nothing to confirm: no copies of the weights (a 1.5B model's 14 GB)
    saved = model.kernel_plan
    trial = KernelPlan(tuple(choice), "ss", True, threads, "trial")
    packs = KernelPlan(((1, "ss"), (None, "onednn" if trial.uses_onednn else "mkl")), "ss", True, threads, "trial")
    cfg, P = model.cfg, FORWARD_TRIAL_CONTEXT
    out, timings = [], {}
    try:
        model.kernel_plan = packs
        model.prepack_()  # panels and oneDNN's copies, both kept while both plans are timed
        for i, (upper, be) in enumerate(choice):
            if be == "ss" or upper is None or upper > FORWARD_TRIAL_UPTO:
                out.append((upper, be))
                continue
            ours = KernelPlan(tuple((u, "ss" if j == i else b) for j, (u, b) in enumerate(choice)), "ss", True,
                              threads, "trial")
            keep = True
            for width in dict(LINEAR_RANGES)[upper]:
                T = forward_trial_tokens(width)
                B = width // T  # B x T == width: the forward runs the range under test
                cache = KVCache(cfg, B, P + T + 1, model.dtype, "cpu")
                g = torch.Generator().manual_seed(0)
                cache.k.normal_(generator=g)
                cache.v.normal_(generator=g)
                ring = RowsTarget(torch.empty(cfg.num_layers, B, cfg.num_kv_heads, T, P + T), torch.arange(T).repeat(B, 1))
                ids = torch.full((B, T), 42)

                def run(plan, B=B, ids=ids, cache=cache, ring=ring):
                    model.kernel_plan = plan
                    cache.lengths = [P] * B
                    model.forward_dense_features(ids, cache, rows_into=ring)

                with torch.inference_mode():
                    t = timer({"ss": lambda: run(ours), be: lambda: run(trial)}, max(1, reps - 1))
                timings[str(width)] = t
                keep = keep and t[be] * (1.0 + TIE_MARGIN) < t["ss"]
            out.append((upper, be if keep else "ss"))
    finally:
        model.kernel_plan = saved
        model.prepack_()
    return out, timings


def tune_plan(model, reps: int = 3, *, progress: Callable[[str], None] | None = None) -> KernelPlan:
    """Measure (or read this machine's cached measurements) and return the fastest plan."""
    threads = torch.get_num_threads()
    path = _cache_path(model, threads)
    if path.exists():
        try:
            data = json.loads(path.read_text())
            return KernelPlan(tuple((u, be) for u, be in data["linear"]), data["attention"], data["fused"],
                              threads, "cache", data.get("tune_s", 0.0), data.get("timings", {}), data.get("note", ""),
                              data.get("attention_tiles", ""), data.get("linear_tiles", ""),
                              int(data.get("attention_kt_rows", 0)), bool(data.get("attention_kt_vprefetch", True)),
                              data.get("prefill_attention", "torch"),
                              attention_pv_prefetch=int(data.get("attention_pv_prefetch", cpu.PV_PREFETCH_KEYS)),
                              attention_decode_kprefetch=int(data.get("attention_decode_kprefetch",
                                                                      cpu.DECODE_KPREFETCH_KEYS)),
                              attention_next_kprefetch=bool(data.get("attention_next_kprefetch", True)),
                              attention_verify_kprefetch=int(data.get("attention_verify_kprefetch",
                                                                      cpu.VERIFY_KPREFETCH_T)),
                              linear_wide_prefetch=int(data.get("linear_wide_prefetch",
                                                                cpu.LINEAR_WIDE_PREFETCH_ROWS)))
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a corrupt cache entry: measure again
    if progress:
        progress(f"measuring kernel choices for this CPU ({cpu.cpu_model()}, {threads} threads)")
    t0 = time.perf_counter()
    backends = ["ss"] + (["onednn"] if prepack_available() else []) + ["mkl"]
    if cpu.set_linear_avx512(True) == "avx512":
        backends.append("ss-avx2")
    lin = _linear_trial(model, backends, reps)
    linear_tiles = ""
    if "ss-avx2" in backends:  # the AVX-512 tile unless the AVX2 ones measured faster over all widths
        linear_tiles = "avx2" if sum(v["ss-avx2"] for v in lin.values()) < sum(v["ss"] for v in lin.values()) \
            else "avx512"
        cpu.set_linear_avx512(linear_tiles == "avx512")
        lin_all, lin = lin, {m: {be: t for be, t in v.items() if be != "ss-avx2"} for m, v in lin.items()}
        if linear_tiles == "avx2":
            lin = {m: {**v, "ss": lin_all[m]["ss-avx2"]} for m, v in lin.items()}
    lin_fetch = _linear_fetch_trial(model)  # on the tiles chosen above
    lw = linear_wide_prefetch_from_trial(lin_fetch)
    cpu.set_linear_wide_prefetch(lw)  # before the whole forwards below
    att = _attention_trial(model, reps)
    choice = []
    for upper, widths in LINEAR_RANGES:
        worst = range_worst(lin, widths)
        be = min(worst, key=worst.get)
        if upper is not None and be != "ss" and "ss" in worst and worst["ss"] <= worst[be] * (1.0 + TIE_MARGIN):
            be = "ss"  # a decode range within the trial's noise: keep ours (one kernel for every width:
            # batch-invariant); prefill (the open range) goes to the fastest
        choice.append((upper, be))
    base = [s for s in att if "torch" in att[s]]  # the decode and verify widths
    att_total = {be: sum(att[s][be] for s in base) for be in ("ss", "torch")}
    attention = min(att_total, key=att_total.get)
    tiles, kt_rows, kt_vprefetch, pv, nk, vk = "", 0, True, cpu.PV_PREFETCH_KEYS, True, cpu.VERIFY_KPREFETCH_T
    dk = decode_kprefetch_from_trial(att)
    cpu.set_attention_decode_kprefetch(dk)
    if all("ss-avx2" in att[s] for s in base):  # the AVX-512 tiles unless the AVX2 ones measured faster
        tiles = "avx2" if sum(att[s]["ss-avx2"] for s in base) < att_total["ss"] else "avx512"
        if tiles == "avx2":
            att_total["ss"] = sum(att[s]["ss-avx2"] for s in base)
        else:  # and the keys-in-lanes score tiles from the row count where they measured faster
            pv = pv_prefetch_from_trial(att)  # (the P.V's fetch distance, measured in the fetch trial)
            nk = next_kprefetch_from_trial(att)
            vk = verify_kprefetch_from_trial(att)
            group = model.cfg.num_heads // model.cfg.num_kv_heads
            kt = kt_variant_from_trial(att)
            kt_rows = kt_rows_from_trial(att, group, kt)
            if kt_rows:
                tiles, kt_vprefetch = "avx512-kt", kt == "ss-kt"
                att_total["ss"] = sum(att[s][kt if group * int(s[1:]) >= kt_rows else "ss"] for s in base)
        attention = min(att_total, key=att_total.get)
        cpu.set_attention_avx512(tiles != "avx2")  # before the whole forwards below
        cpu.set_attention_kt(kt_rows)
        cpu.set_attention_kt_vprefetch(kt_vprefetch)
        cpu.set_attention_pv_prefetch(pv)
        cpu.set_attention_next_kprefetch(nk)
        cpu.set_attention_verify_kprefetch(vk)
    pre = _prefill_trial(model, reps) if attention == "ss" else {}
    prefill = "ss" if pre and pre["ss"] < pre["torch"] else "torch"
    fwd: dict[str, dict[str, float]] = {}
    if attention == "ss" and any(be != "ss" for _, be in choice):
        choice, fwd = _confirm_in_forward(model, choice, threads, reps)
    ranges: list[tuple[int | None, str]] = []
    for upper, be in choice:
        if ranges and ranges[-1][1] == be:
            ranges[-1] = (upper, be)
        else:
            ranges.append((upper, be))
    if linear_tiles:
        lin = lin_all
    timings = {"linear": {str(m): v for m, v in lin.items()}, "linear_fetch": lin_fetch, "attention": att,
               "forward": fwd, "prefill": pre,
               "read_bytes_per_s": _read_bandwidth()}
    tune_s = time.perf_counter() - t0
    plan = KernelPlan(tuple(ranges), attention, True, threads, "measured", tune_s, timings,
                      attention_tiles=tiles if attention == "ss" else "",
                      linear_tiles=linear_tiles if any(be == "ss" for _, be in ranges) else "",
                      attention_kt_rows=kt_rows if attention == "ss" else 0,
                      attention_kt_vprefetch=kt_vprefetch if attention == "ss" and kt_rows else True,
                      prefill_attention=prefill, attention_pv_prefetch=pv, attention_decode_kprefetch=dk,
                      attention_next_kprefetch=nk, attention_verify_kprefetch=vk, linear_wide_prefetch=lw)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"linear": [list(r) for r in plan.linear], "attention": plan.attention,
                                   "attention_tiles": plan.attention_tiles, "linear_tiles": plan.linear_tiles,
                                   "attention_kt_rows": plan.attention_kt_rows,
                                   "attention_kt_vprefetch": plan.attention_kt_vprefetch,
                                   "attention_pv_prefetch": plan.attention_pv_prefetch,
                                   "attention_decode_kprefetch": plan.attention_decode_kprefetch,
                                   "attention_next_kprefetch": plan.attention_next_kprefetch,
                                   "attention_verify_kprefetch": plan.attention_verify_kprefetch,
                                   "linear_wide_prefetch": plan.linear_wide_prefetch,
                                   "prefill_attention": plan.prefill_attention,
                                   "fused": plan.fused, "tune_s": tune_s, "timings": timings,
                                   "cpu": cpu.cpu_model(), "isa": cpu.isa_summary(), "threads": threads,
                                   "torch": torch.__version__}, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # an unwritable cache: the plan still holds for this process
    return plan


def _read_bandwidth(nbytes: int = 256 << 20, reps: int = 5) -> float:
    x = torch.ones(nbytes // 4)
    return nbytes / min(_best_of({"sum": lambda: x.sum()}, reps).values())


def pack_weights(weights, plan: KernelPlan) -> int:
    """Give each dense fp32/bf16 CPU weight the copies ``plan`` reads (our panels for ``"ss"``,
    oneDNN's for ``"onednn"``) and drop the others. Returns the bytes the copies hold. The
    copies are snapshots: after changing a weight in place, call it again."""
    from sparsespec.quant import prepack_

    total = prepack_(weights, plan.uses_onednn)
    for w in weights:
        if isinstance(w, Int8Weight) or w is None:
            continue
        if plan.uses_panels and cpu.supports(w) and w.dim() == 2 and cpu.available():
            wp = cpu.pack_weight(w.detach())
            setattr(w, PANELS_ATTR, wp)
            total += wp.numel() * wp.element_size()
        elif hasattr(w, PANELS_ATTR):
            delattr(w, PANELS_ATTR)
    return total
