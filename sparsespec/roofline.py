"""Machine probes and roofline arithmetic: what one decode step must cost on this machine.

Pure arithmetic plus two small probes; no Ray, no SQL (``torch`` is imported lazily, only by
the probes). ``cluster.speed.measure`` measures with it and the dashboard (``dashboard.queries``)
derives its roofline table with it.

Units: seconds, bytes, FLOPs; bandwidth in bytes/s, compute in FLOP/s. A step's roofline is
``max(memory floor, compute floor)`` with

* memory floor  = (weights read once + the KV the step must read) / measured read bandwidth;
* compute floor = matmul FLOPs of the step / measured GEMM throughput.

``machine`` dicts (``measure_machine``) hold ``read_bytes_per_s`` and ``gemm_flops_per_s`` (the fastest
GEMM this process can run, named in ``gemm_backend``).
"""
from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["ReadProbe", "gemm_call", "geometry", "geometry_roofline", "kv_bytes", "machine_desc", "max_speedup",
           "measure_machine", "roofline", "roofline_speedup", "step_flops", "time_call", "weight_bytes", "x_roofline"]


# --------------------------------------------------------------------------- probes
def _sync(device: Any) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_call(fn: Callable[[], Any], device: Any, reps: int, warmup: int,
              between: Callable[[], Any] | None = None) -> float:
    """Median wall seconds of ``fn()`` over ``reps`` calls after ``warmup`` untimed ones
    (the device is synchronised before each clock read). ``between`` (e.g. ``ReadProbe.tagged``)
    is called, untimed, after each timed call: a sample of the machine beside every rep."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
        if between is not None:
            between()
    return statistics.median(times)


class ReadProbe:
    """The memory read bandwidth (and the GEMM rate) beside timed work: each call times one
    ``x.sum()`` over a float32 buffer of ``nbytes`` (256 MiB: far larger than any CPU cache, ~3 ms
    at 80 GB/s) and keeps the rate (bytes/s) under the call's ``tag`` in ``samples``; with ``gemm``
    (``gemm_call``'s ``(call, flops)``: the product ``measure_machine`` found fastest), it also
    times one product and keeps its rate (FLOP/s) under the tag in ``gemm_samples``.

    Why: a shared host's bandwidth drops for seconds at a time (on the 2-core AMD EPYC of
    benchmarks/RESULTS.md, from 80-85 to 48-55 GB/s in every buffer at once, the model's own
    weights included, for seconds to minutes), and a step timed then looks 1.4x slower against a
    roofline at the run's best rate. Sampled between the reps of the step it judges (one tag per
    step), ``median(tag)`` is the rate that step ran at, and ``spread(tag)`` (max / min) says
    whether the host moved meanwhile. The same holds for its arithmetic: on that host the GEMM rate
    moved between 104 and 162 GFLOP/s within minutes, and a compute-bound step (a verify at batch 4
    x 8K) timed in a slow minute looked 1.5x further from its roofline; ``gemm_median(tag)`` is the
    rate it ran at.
    """

    def __init__(self, device: Any = "cpu", nbytes: int = 256 << 20,
                 gemm: tuple[Callable[[], Any], float] | None = None) -> None:
        import torch

        if nbytes < 4:
            raise ValueError(f"nbytes must be at least 4, got {nbytes}")
        self.device = device
        self.nbytes = nbytes // 4 * 4
        self._x = torch.ones(self.nbytes // 4, dtype=torch.float32, device=device)
        self._gemm = gemm
        self.samples: dict[str, list[float]] = {}
        self.gemm_samples: dict[str, list[float]] = {}

    def __call__(self, tag: str = "") -> float:
        """Sample (the read, then the product where given) under ``tag``; returns the read's rate."""
        _sync(self.device)
        t0 = time.perf_counter()
        self._x.sum()
        _sync(self.device)
        rate = self.nbytes / max(time.perf_counter() - t0, 1e-9)
        self.samples.setdefault(tag, []).append(rate)
        if self._gemm is not None:
            call, flops = self._gemm
            t0 = time.perf_counter()
            call()
            _sync(self.device)
            self.gemm_samples.setdefault(tag, []).append(flops / max(time.perf_counter() - t0, 1e-9))
        return rate

    def tagged(self, tag: str) -> Callable[[], float]:
        """A call that samples under ``tag`` (``time_call``'s ``between``)."""
        return lambda: self(tag)

    @staticmethod
    def _of(samples: dict[str, list[float]], tag: str | None) -> list[float]:
        return [x for v in samples.values() for x in v] if tag is None else samples.get(tag, [])

    @classmethod
    def _median(cls, samples: dict[str, list[float]], tag: str | None) -> float | None:
        xs = cls._of(samples, tag)
        return statistics.median(xs) if xs else None

    @classmethod
    def _spread(cls, samples: dict[str, list[float]], tag: str | None) -> float | None:
        xs = cls._of(samples, tag)
        return max(xs) / min(xs) if xs else None

    def median(self, tag: str | None = None) -> float | None:
        """Median of ``tag``'s read samples (bytes/s; every sample for None); None before the first."""
        return self._median(self.samples, tag)

    def spread(self, tag: str | None = None) -> float | None:
        """max / min of ``tag``'s read samples (every sample for None); None before the first."""
        return self._spread(self.samples, tag)

    def gemm_median(self, tag: str | None = None) -> float | None:
        """Median of ``tag``'s GEMM samples (FLOP/s; every sample for None); None without any."""
        return self._median(self.gemm_samples, tag)

    def gemm_spread(self, tag: str | None = None) -> float | None:
        """max / min of ``tag``'s GEMM samples (every sample for None); None without any."""
        return self._spread(self.gemm_samples, tag)


def gemm_call(device: str, dtype: Any, backend: str = "torch",
              n: int | None = None) -> tuple[Callable[[], Any], float]:
    """One square product of ``n`` (default: ``measure_machine``'s size here) in ``dtype`` by the
    GEMM ``backend`` (a name of ``measure_machine``'s ``gemm_rates``; ``"torch"`` where that one
    does not run here) and its FLOPs: a ``ReadProbe``'s ``gemm``."""
    import torch

    cuda = torch.device(device).type == "cuda"
    n = n or (8192 if cuda else _cpu_gemm_n(dtype))
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    with torch.inference_mode():
        fns = _gemm_backends(a, b, a @ b, cuda)
    fn = fns.get(backend, fns["torch"])

    def call() -> Any:
        with torch.inference_mode():
            return fn()
    return call, 2.0 * n**3


def measure_machine(device: str, dtype: Any, reps: int = 7) -> dict[str, Any]:
    """Memory read bandwidth (bytes/s) and GEMM throughput (FLOP/s) on ``device``, now.

    Bandwidth: ``x.sum()`` over a float32 buffer of 1 GiB (CPU) or 4 GiB (GPU), the best of
    ``reps`` (a reduction reads every byte once; the buffer is far larger than any cache).

    GEMM: the best of ``reps`` square products in ``dtype`` (CPU: the smallest n of 512, 1024
    and 2048 whose product takes 10 ms, ``_cpu_gemm_n``; GPU: 8192), by every GEMM this process
    can run, the fastest counting: on a CPU ``torch`` (``a @ b``: MKL, which runs AVX2 code on AMD
    CPUs), oneDNN's prepacked linear (``onednn``, where ``sparsespec.quant.prepack_available``)
    and our packed AVX-512/AVX2 linear (``ss``, where ``sparsespec.kernels.cpu`` is built). A
    compute floor from a GEMM slower than the machine can run would let a step read faster than
    its roofline (on the AMD EPYC of benchmarks/RESULTS.md ``a @ b`` ran at 236 GFLOP/s and our
    packed linear at 510). A backend whose product differs from ``a @ b`` by more than rounding
    is left out (a wrong fast kernel must not set the floor).

    Returns ``{"read_bytes_per_s", "gemm_flops_per_s", "gemm_backend" (the fastest's name),
    "gemm_rates" ({backend: FLOP/s}), "gemm_n" (the probe's n)}``.
    """
    import torch

    cuda = torch.device(device).type == "cuda"
    nbytes = (4 << 30) if cuda else (1 << 30)
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    times = []
    for _ in range(reps + 1):
        _sync(device)
        t0 = time.perf_counter()
        x.sum()
        _sync(device)
        times.append(time.perf_counter() - t0)
    read_bw = nbytes / min(times[1:])
    del x
    n = 8192 if cuda else _cpu_gemm_n(dtype)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    rates: dict[str, float] = {}
    with torch.inference_mode():
        ref = a @ b
        for name, fn in _gemm_backends(a, b, ref, cuda).items():
            times = []
            for _ in range(reps + 1):
                _sync(device)
                t0 = time.perf_counter()
                fn()
                _sync(device)
                times.append(time.perf_counter() - t0)
            rates[name] = 2 * n**3 / min(times[1:])
    best = max(rates, key=rates.__getitem__)
    return {"read_bytes_per_s": read_bw, "gemm_flops_per_s": rates[best], "gemm_backend": best, "gemm_rates": rates,
            "gemm_n": n}


#: a CPU GEMM probe's product takes at least this long (s): per-call overheads stay under 1 %
GEMM_PROBE_MIN_S = 0.01


def _cpu_gemm_n(dtype: Any, sizes: tuple[int, ...] = (512, 1024, 2048)) -> int:
    """The smallest of ``sizes`` whose square ``a @ b`` in ``dtype`` takes ``GEMM_PROBE_MIN_S`` or
    more here (its second call), else the largest. The rate per FLOP is the same above that
    (AMD EPYC without AVX-512, fp32, interleaved: 138-158 GFLOP/s at 1024 against 127-155 at 2048 on
    2 threads, 75-85 against 67-78 on one; a faster rate only lowers the floor), and the probe runs
    at every worker start: fp32 there takes 1024 (16 ms a product, an eighth of 2048's time), and a
    bf16 product on a CPU without bf16 instructions, which took 195 s of probing at 2048, takes 512."""
    import torch

    for n in sizes:
        a = torch.randn(n, n).to(dtype)
        with torch.inference_mode():
            a @ a
            t0 = time.perf_counter()
            a @ a
            if time.perf_counter() - t0 >= GEMM_PROBE_MIN_S:
                return n
    return sizes[-1]


def _gemm_backends(a: Any, b: Any, ref: Any, cuda: bool) -> dict[str, Callable[[], Any]]:
    """``a @ b`` by each GEMM that runs here and gives ``ref``'s values to rounding: name -> call."""
    import torch

    fns: dict[str, Callable[[], Any]] = {"torch": lambda: a @ b}
    if cuda or a.dtype not in (torch.float32, torch.bfloat16):
        return fns
    bt = b.t().contiguous()  # [N, K]: a linear's weight (y = a @ bt.T)
    tol = 1e-3 if a.dtype == torch.float32 else 2e-2
    scale = float(ref.abs().max()) or 1.0

    def close(y: Any) -> bool:
        return bool(torch.isfinite(y).all()) and float((y.float() - ref.float()).abs().max()) <= tol * scale

    from sparsespec.quant import prepack_available

    if prepack_available():
        try:
            packed = bt.to_mkldnn()
            fn = lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")  # noqa: E731
            if close(fn()):
                fns["onednn"] = fn
        except Exception:  # noqa: BLE001 - a build without this dtype's path: not a candidate
            pass
    from sparsespec.kernels import cpu

    if cpu.available() and cpu.supports(a):
        wp = cpu.pack_weight(bt)
        fn = lambda: cpu.linear_packed(a, wp, bt.shape[0])  # noqa: E731
        if close(fn()):
            fns["ss"] = fn
    return fns


def machine_desc(device: str) -> str:
    """The GPU's name, or the CPU model and logical CPU count."""
    import torch

    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(0)
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} logical CPUs"


# --------------------------------------------------------------------------- bytes and FLOPs
def weight_bytes(model: Any) -> int:
    """Bytes every forward must read: each linear weight once (int8 weights of a quantised
    target with their scales), the biases and norms; the input embedding is only gathered (a
    few rows), so it is excluded unless it is also the (full-precision) tied LM head."""
    from sparsespec.quant import linear_weights, nbytes

    small = sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() == 1)  # norms, biases
    return sum(nbytes(w) for w in linear_weights(model)) + small


def kv_bytes(cfg: Any, element_size: int, batch: int, positions: float) -> float:
    """Bytes of K and V for ``positions`` cached tokens per row, every layer and KV head."""
    return _kv(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, element_size, batch, positions)


def _kv(layers: int, kv_heads: int, head_dim: int, element_size: int, batch: float, positions: float) -> float:
    return batch * layers * 2 * kv_heads * positions * head_dim * element_size


def step_flops(model: Any, batch: int, tokens: int, keys: float) -> float:
    """Matmul FLOPs of one forward: ``tokens`` new tokens per row attending to ``keys`` keys."""
    return _flops(geometry(model), batch, tokens, keys)


def _flops(geom: Mapping[str, Any], batch: float, tokens: float, keys: float,
           logit_tokens: float | None = None) -> float:
    """``logit_tokens``: how many of the ``tokens`` need the LM head (None: all; a prefill needs
    only its last), where the geometry knows the head's size (``head_params``)."""
    attn = 4 * geom["num_layers"] * geom["num_heads"] * geom["head_dim"] * keys
    head = geom.get("head_params", 0) if logit_tokens is not None else 0
    linear = tokens * (geom["linear_params"] - head) + (logit_tokens or 0) * head
    return 2.0 * batch * linear + batch * tokens * attn


def geometry(model: Any) -> dict[str, Any]:
    """What a roofline needs of ``model``, as plain numbers (JSON; a store keeps it with a run so
    a report derives floors without loading the weights): ``weight_bytes`` (``weight_bytes``),
    ``linear_params`` (multiply-accumulates per token of the projections and the LM head),
    ``head_params`` (those of the LM head alone: a prefill runs it for its last position only),
    ``num_layers``, ``num_heads``, ``num_kv_heads``, ``head_dim`` and ``element_size`` (bytes
    of one K/V element)."""
    from sparsespec.quant import linear_weights, numel

    cfg = model.cfg
    return {"weight_bytes": int(weight_bytes(model)),
            "linear_params": int(sum(numel(w) for w in linear_weights(model))),
            "head_params": int(cfg.vocab_size * cfg.hidden_size),
            "num_layers": int(cfg.num_layers), "num_heads": int(cfg.num_heads),
            "num_kv_heads": int(cfg.num_kv_heads), "head_dim": int(cfg.head_dim),
            "element_size": int(model.embed.element_size())}


def draft_weight_bytes(model: Any, weights: Any) -> int:
    """Bytes a draft forward over ``weights`` (``sparsespec.quant.DraftWeights``; None = the
    model's own) reads of weights: the int8 linear weights and their scales, plus what stays
    full precision (the norms; the input embedding is gathered, not read)."""
    if weights is None:
        return weight_bytes(model)
    small = sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() == 1)
    return weights.nbytes + small


def roofline(model: Any, machine: Mapping[str, float], batch: int, tokens: int, kv_positions: float,
             attn_keys: float | None = None, weight_nbytes: float | None = None,
             logit_tokens: float | None = None) -> dict[str, float]:
    """Floors of one step: ``{"bytes", "mem_s", "compute_s", "roofline_s"}`` (bytes, seconds).

    ``tokens`` new tokens per row over a cache of ``kv_positions`` tokens per row (the KV the
    step reads); ``attn_keys`` (default ``kv_positions``) the keys each new token attends to;
    ``weight_nbytes`` the weight bytes the step reads (default ``weight_bytes(model)``; a
    quantised draft: ``draft_weight_bytes``); ``logit_tokens`` how many of the ``tokens`` per row
    need logits (default all; a prefill: 1).
    """
    return geometry_roofline(geometry(model), machine, batch, tokens, kv_positions, attn_keys, weight_nbytes,
                             logit_tokens)


def geometry_roofline(geom: Mapping[str, Any], machine: Mapping[str, float], batch: float, tokens: float,
                      kv_positions: float, attn_keys: float | None = None,
                      weight_nbytes: float | None = None, logit_tokens: float | None = None) -> dict[str, float]:
    """``roofline`` from a model's ``geometry`` (no weights needed); ``batch`` and ``tokens``
    may be means (floats)."""
    wb = geom["weight_bytes"] if weight_nbytes is None else weight_nbytes
    nbytes = wb + _kv(geom["num_layers"], geom["num_kv_heads"], geom["head_dim"], geom["element_size"], batch,
                      kv_positions)
    mem_s = nbytes / machine["read_bytes_per_s"]
    keys = kv_positions if attn_keys is None else attn_keys
    comp_s = _flops(geom, batch, tokens, keys, logit_tokens) / machine["gemm_flops_per_s"]
    return {"bytes": nbytes, "mem_s": mem_s, "compute_s": comp_s, "roofline_s": max(mem_s, comp_s)}


# --------------------------------------------------------------------------- speedups
def roofline_speedup(tau: float | None, mean_k: float | None, ar_step_s: float | None,
                     draft_step_s: float | None, verify_s: float | None, drafting_frac: float = 1.0) -> float | None:
    """Speedup of a draft/verify cycle over AR: ``tau * ar_step_s / (mean_k * draft_step_s + verify_s)``.

    ``tau``: tokens emitted per cycle (verify step); ``mean_k``: drafted tokens per cycle (draft
    forwards); ``ar_step_s``, ``draft_step_s`` (one draft forward), ``verify_s`` (one verify of
    ``k + 1`` tokens): seconds. ``drafting_frac``: the fraction of steps that drafted (an
    adaptive k may choose k = 0: such a step costs one AR step), so the mean step costs
    ``f * (mean_k * draft_step_s + verify_s) + (1 - f) * ar_step_s``. With the steps at their
    roofline floors this is what the roofline allows at the measured acceptance; with measured
    step times, what those times predict. None when a term is unknown or the cycle costs nothing.
    """
    if tau is None or mean_k is None or ar_step_s is None or draft_step_s is None or verify_s is None:
        return None
    if not 0.0 <= drafting_frac <= 1.0:
        raise ValueError(f"drafting_frac must be in [0, 1], got {drafting_frac}")
    cycle = drafting_frac * (mean_k * draft_step_s + verify_s) + (1.0 - drafting_frac) * ar_step_s
    return tau * ar_step_s / cycle if cycle > 0 else None


def max_speedup(k: int, ar_step_s: float | None, draft_step_s: float | None,
                verify_s: float | None) -> float | None:
    """Best case at draft length ``k`` (every draft accepted: ``k + 1`` tokens per cycle of ``k``
    drafts and one verify): ``roofline_speedup(k + 1, k, ...)``."""
    return roofline_speedup(k + 1, k, ar_step_s, draft_step_s, verify_s)


def x_roofline(measured_s: float | None, floor_s: float | None) -> float | None:
    """A measured time as a multiple of its floor (1.0 = at the roofline); None if unknown."""
    if measured_s is None or not floor_s:
        return None
    return measured_s / floor_s
