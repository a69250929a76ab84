"""Our CPU kernels (``cpu/sparsespec_cpu.c``): built at first use, called through ctypes.

What they are for: a decode step's matmuls are skinny (1-64 rows against weights far larger
than the caches) and its attention has a few query rows per KV head over thousands of keys.
PyTorch's CPU paths read the weights and the KV cache at a fraction of the machine's bandwidth
there (``benchmarks/RESULTS.md``). The kernels here stream each weight tile and each key once,
split the work over torch's own OpenMP threads, and fuse the small ops of a layer:

* ``linear_packed``: ``y = x @ W.T (+ b)`` (or ``y += ...``, the residual add fused) over a copy of
  W packed in panels of 16 output columns (``pack_weight``), a BLIS-style 6 x 16 outer-product
  micro-kernel; ``linear`` the same over the plain ``[N, K]`` weight (dot products, no copy);
* ``attention``: causal attention of a ragged batch (decode, verify) with the importance rows of
  the last W queries; ``sparse_attention``: the draft's attention over indexed cache positions
  plus its own tail (the index is gathered inside the kernel: no compact copy);
* ``prefill_attention``: a prefill chunk's causal attention (flash, the query rows in lanes; AVX-512
  builds only), equal to a softmax up to rounding but not bitwise a decode step's;
* ``rms_norm``, ``silu_mul``, ``rope_split`` (RoPE of q and k, q laid out per KV group).

Built on a CPU with AVX-512, the attention and the packed linear also have 16-lane tiles (two
query rows per vector in the scores, exp and P.V in 16 lanes; 12 rows x two weight panels) that run
the same operations in the same order, so their results are bitwise the AVX2 tiles'. They are on
by default; ``set_attention_avx512`` / ``set_linear_avx512`` / ``SPARSESPEC_AVX512=0`` switch them
off, and the kernel plan's trial times both (``KernelPlan.attention_tiles``, ``linear_tiles``).

Every output element is a fixed sequence of operations on its own inputs, so a row's result does
not depend on its batch, on the number of queries of the step, or on the threads: a verify's
logits equal the AR step's bit for bit (see the C file's header).

Build: the machine's C compiler (``$CC``, else ``cc``/``gcc``) with ``-O3 -march=native -fopenmp``,
into ``$SPARSESPEC_CACHE/kernels/`` keyed by the source, the flags, the compiler and the CPU
(model and ISA flags), so another CPU builds its own. About a second; done once per machine.
The library links ``libgomp.so.1``, the same soname torch has loaded, so both share one OpenMP
runtime and thread pool. ``SPARSESPEC_CPU_KERNELS=0`` disables them; when they cannot be built
(no compiler, no AVX2/FMA) ``available()`` is False and ``unavailable_reason()`` says why, and
the model runs PyTorch's ops.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu") / "sparsespec_cpu.c"
ABI_VERSION = 19
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared")
#: keys per attention chunk in the C kernels (SS_CHUNK)
CHUNK = 256
#: the dense P.V's value fetch distance the library starts with and the plan's trial tries against 0
#: (16 beat 8, 32 and 64 on the AMD EPYC of benchmarks/RESULTS.md, twenty-fifth session)
PV_PREFETCH_KEYS = 16
#: how far ahead a one-token forward's score loop fetches keys into L2, the library's start and what
#: the plan's trial tries against 0 (32 and 64 both 8-15 % faster than none at T = 1 on that CPU)
DECODE_KPREFETCH_KEYS = 32
#: the widest verify (query positions) in the row-pair score tiles whose P.V also fetches the next
#: chunk's keys, the library's start and what the plan's fetch trial tries against 0 (a k = 2 verify,
#: timed at that width; a k = 8 verify measured slower with it on that CPU, twenty-seventh session)
VERIFY_KPREFETCH_T = 3
#: how many rows of a weight panel the packed linear's first row tile fetches ahead where the rows
#: take two or more tiles (a verify's widths), the library's start; the plan's trial tries
#: ``LINEAR_WIDE_PREFETCH_FAR`` against it (128 took 0.89-0.92x of the time of SmolLM2's linears at
#: M = 7-10 and 0.97x at 12 on the AMD EPYC without AVX-512 of benchmarks/RESULTS.md, thirty-sixth
#: session; up to 6 % slower in one tile, which keeps ``LINEAR_WIDE_PREFETCH_ROWS`` whatever the setting)
LINEAR_WIDE_PREFETCH_ROWS, LINEAR_WIDE_PREFETCH_FAR = 16, 128
#: the most rows ahead ``set_linear_wide_prefetch`` takes (the library clamps to it)
LINEAR_PREFETCH_MAX = 1024
#: rows of one packed linear row tile per ``linear_isa()`` (SS_P5_MR, and the AVX2 tiles' 6)
LINEAR_TILE_ROWS = {"avx2": 6, "avx512": 12}
_ENV = "SPARSESPEC_CPU_KERNELS"
#: ``0`` keeps the attention and the packed linear on their AVX2 tiles where the library was built
#: with AVX-512
ENV_AVX512 = "SPARSESPEC_AVX512"
_state: dict[str, object] = {}
_lock = threading.Lock()


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else ``platform.processor()``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=None)
def cpu_flags() -> tuple[str, ...]:
    """The CPU's ISA flags (``/proc/cpuinfo``), sorted; empty where unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return tuple(sorted(set(line.split(":", 1)[1].split())))
    except OSError:
        pass
    return ()


#: the ISA flags that decide which kernels run well (reported with every bench row)
ISA_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni",
             "amx_tile", "amx_bf16", "amx_int8", "avx_vnni")


def isa_summary() -> str:
    """The ``ISA_FLAGS`` this CPU has, space-separated."""
    have = set(cpu_flags())
    return " ".join(f for f in ISA_FLAGS if f in have)


def cache_dir() -> Path:
    return Path(os.environ.get("SPARSESPEC_CACHE", Path.home() / ".cache" / "sparsespec")).expanduser() / "kernels"


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc) or (cc if Path(cc).exists() else None)
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _build() -> Path:
    """Compile the library if this machine has not yet (returns its path).

    Raises:
        RuntimeError: naming the cause (no compiler, no AVX2/FMA, a compiler error).
    """
    if platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"the CPU kernels are x86-64 only (this machine: {platform.machine()})")
    flags = set(cpu_flags())
    if flags and not {"avx2", "fma"} <= flags:
        raise RuntimeError("the CPU kernels need AVX2 and FMA; this CPU lacks them")
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set $CC or install gcc)")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError) as e:
        raise RuntimeError(f"{cc} --version failed: {e}") from None
    src = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([src, " ".join(FLAGS).encode(), version.encode(), cpu_model().encode(),
                                     " ".join(cpu_flags()).encode(), str(ABI_VERSION).encode()])).hexdigest()[:16]
    out = cache_dir() / f"sparsespec_cpu-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        res = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            raise RuntimeError(f"building the CPU kernels failed ({cc}): {res.stderr.strip()[-2000:]}")
        os.replace(tmp, out)  # atomic: concurrent builders race harmlessly
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


_I64, _PTR, _F32, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "ss_abi_version": ([], _INT),
    "ss_linear": ([_I64, _I64, _I64, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _INT, _INT], None),
    "ss_linear_packed": ([_I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _INT, _INT], None),
    "ss_pack_numel": ([_I64, _I64], _I64),
    "ss_pack_weight": ([_I64, _I64, _PTR, _I64, _PTR, _INT], None),
    "ss_rms_norm": ([_I64, _I64, _PTR, _I64, _PTR, _F32, _PTR, _I64, _INT], None),
    "ss_silu_mul": ([_I64, _I64, _PTR, _I64, _PTR, _I64, _INT], None),
    "ss_rope_split": ([_I64, _I64, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _INT], None),
    "ss_attention_workspace": ([_I64] * 6 + [_INT], _I64),
    "ss_attention": ([_I64] * 5 + [_PTR, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _F32, _PTR, _I64, _I64, _PTR,
                                   _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _I64, _INT], None),
    "ss_prefill_attention": ([_I64] * 5 + [_PTR, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _F32, _PTR, _I64, _I64,
                                           _INT], _INT),
    "ss_forward_struct_size": ([], _I64),
    "ss_forward_layers": ([_PTR], None),
    "ss_build_index": ([_I64, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _PTR, _I64, _I64, _INT], None),
    "ss_compact_update": ([_I64] * 3 + [_PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64,
                                        _PTR, _PTR, _I64, _I64, _INT], _I64),
    "ss_set_attention_avx512": ([_INT], _INT),
    "ss_set_linear_avx512": ([_INT], _INT),
    "ss_set_attention_kt": ([_INT], _INT),
    "ss_set_attention_kt_vprefetch": ([_INT], _INT),
    "ss_set_attention_pv_prefetch": ([_INT], _INT),
    "ss_set_attention_decode_kprefetch": ([_INT], _INT),
    "ss_set_attention_next_kprefetch": ([_INT], _INT),
    "ss_set_attention_verify_kprefetch": ([_INT], _INT),
    "ss_set_linear_wide_prefetch": ([_INT], _INT),
    "ss_sparse_attention": ([_I64] * 5 + [_PTR, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR,
                                          _PTR, _I64, _I64, _I64, _F32, _PTR, _I64, _I64, _PTR, _I64, _INT], None),
}


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (``unavailable_reason()`` says why). Built on first call."""
    with _lock:
        if "lib" in _state:
            return _state["lib"]  # type: ignore[return-value]
        lib, reason = None, None
        if os.environ.get(_ENV, "1").strip().lower() in ("0", "false", "off", "no"):
            reason = f"{_ENV}=0"
        else:
            try:
                t0 = time.perf_counter()
                path = _build()
                _state["build_s"] = time.perf_counter() - t0  # ~0 when this machine built it before
                lib = ctypes.CDLL(str(path))
                for name, (args, res) in _SIGNATURES.items():
                    fn = getattr(lib, name)
                    fn.argtypes, fn.restype = args, res
                if lib.ss_abi_version() != ABI_VERSION:
                    raise RuntimeError(f"{path}: ABI {lib.ss_abi_version()} != {ABI_VERSION}")
                for key in _TILE_SWITCHES:
                    _switch_tiles(lib, key, True)
                _state["attention_kt"] = int(lib.ss_set_attention_kt(0))  # the plan's trial switches it on
                _state["kt_vprefetch"] = bool(lib.ss_set_attention_kt_vprefetch(1))
                _state["pv_prefetch"] = int(lib.ss_set_attention_pv_prefetch(PV_PREFETCH_KEYS))
                _state["decode_kprefetch"] = int(lib.ss_set_attention_decode_kprefetch(DECODE_KPREFETCH_KEYS))
                _state["next_kprefetch"] = bool(lib.ss_set_attention_next_kprefetch(1))
                _state["verify_kprefetch"] = int(lib.ss_set_attention_verify_kprefetch(VERIFY_KPREFETCH_T))
                _state["linear_wide_prefetch"] = int(lib.ss_set_linear_wide_prefetch(LINEAR_WIDE_PREFETCH_ROWS))
                _state["path"] = str(path)
            except (RuntimeError, OSError, AttributeError) as e:
                lib, reason = None, str(e)
        _state["lib"], _state["reason"] = lib, reason
        return lib


def available() -> bool:
    """True when the kernels are built and loaded (and not disabled by ``SPARSESPEC_CPU_KERNELS=0``)."""
    return library() is not None


def unavailable_reason() -> str | None:
    library()
    return _state.get("reason")  # type: ignore[return-value]


def build_seconds() -> float | None:
    """Seconds the first ``library()`` call spent building (or finding) the library."""
    library()
    return _state.get("build_s")  # type: ignore[return-value]


def _avx512_allowed() -> bool:
    return os.environ.get(ENV_AVX512, "1").strip().lower() not in ("0", "false", "off", "no")


#: the process-wide tile switches of the library: state key -> its C setter
_TILE_SWITCHES = {"attention_isa": "ss_set_attention_avx512", "linear_isa": "ss_set_linear_avx512"}


def _switch_tiles(lib: ctypes.CDLL, key: str, on: bool) -> str:
    """Call ``key``'s setter (AVX-512 tiles on unless ``SPARSESPEC_AVX512=0``) and record what runs."""
    _state[key] = "avx512" if getattr(lib, _TILE_SWITCHES[key])(int(bool(on) and _avx512_allowed())) else "avx2"
    return _state[key]  # type: ignore[return-value]


def _set_tiles(key: str, on: bool) -> str | None:
    lib = library()
    if lib is None:
        return None
    with _lock:
        return _switch_tiles(lib, key, on)


def set_attention_avx512(on: bool) -> str | None:
    """Switch the attention's AVX-512 tiles on or off for this process (the results are bitwise
    the same either way: a speed choice). ``SPARSESPEC_AVX512=0`` keeps them off. Returns
    ``attention_isa()``."""
    _set_tiles("attention_isa", on)
    return attention_isa()


def set_attention_kt(min_rows: int) -> str | None:
    """Run the attention's scores in keys-in-lanes tiles for every (batch row, KV head) with at
    least ``min_rows`` query rows (G * T: a verify's width), 0: never. They run where the AVX-512
    tiles do: a block of 32 keys transposed once, then GEMM-like tiles of up to 12 query rows without
    horizontal sums (bitwise the same scores). The transpose pays only when enough rows share it, so
    the kernel plan's trial measures ``min_rows`` at load. Returns ``attention_isa()``."""
    lib = library()
    if lib is None:
        return None
    with _lock:
        _state["attention_kt"] = int(lib.ss_set_attention_kt(max(0, int(min_rows))))
    return attention_isa()


def set_attention_kt_vprefetch(on: bool) -> bool | None:
    """Whether the keys-in-lanes path fetches each block's value rows into L2 while it computes
    the block's scores (True, the library's default) or leaves them to the P.V phase (False):
    a speed choice (the same results), which the kernel plan's trial measures at load. Returns the
    setting (None: no kernels)."""
    return _set_switch("kt_vprefetch", "ss_set_attention_kt_vprefetch", on)


def _set_switch(key: str, setter: str, on: bool) -> bool | None:
    """Call the library's on/off ``setter`` and record what it set under ``key``; None when the
    kernels are unavailable."""
    lib = library()
    if lib is None:
        return None
    with _lock:
        _state[key] = bool(getattr(lib, setter)(int(bool(on))))
    return _state[key]


def _set_distance(key: str, setter: str, keys_ahead: int) -> int | None:
    """Call the library's fetch ``setter`` (a distance in keys or rows, or a verify width; it clamps
    to [0, CHUNK], the linear's rows to [0, LINEAR_PREFETCH_MAX]) and record what it set under
    ``key``; None when the kernels are unavailable."""
    lib = library()
    if lib is None:
        return None
    with _lock:
        _state[key] = int(getattr(lib, setter)(max(0, int(keys_ahead))))
    return _state[key]


def set_attention_pv_prefetch(keys_ahead: int) -> int | None:
    """How many keys ahead the dense attention's P.V (decode and verify, the AVX-512 tiles) fetches
    value rows into L1 as it goes (0: none, leaving them to the hardware prefetcher; capped at
    ``CHUNK``): a speed choice (the same results) that depends on the CPU, which the kernel plan's
    trial measures at load (``PV_PREFETCH_KEYS`` or 0). Returns the setting (None: no kernels)."""
    return _set_distance("pv_prefetch", "ss_set_attention_pv_prefetch", keys_ahead)


def attention_pv_prefetch() -> int:
    """The dense P.V's value fetch distance in keys (``set_attention_pv_prefetch``; 0: off)."""
    library()
    return int(_state.get("pv_prefetch", PV_PREFETCH_KEYS))


def set_attention_decode_kprefetch(keys_ahead: int) -> int | None:
    """How many keys ahead a one-token forward's attention (decode, the sparse draft: T = 1)
    fetches keys into L2 while it computes scores (0: none beyond the near fetch into L1; capped at
    ``CHUNK``): a speed choice (the same results) that depends on the CPU, which the kernel plan's
    trial measures at load (``DECODE_KPREFETCH_KEYS`` or 0). Returns the setting (None: no kernels)."""
    return _set_distance("decode_kprefetch", "ss_set_attention_decode_kprefetch", keys_ahead)


def attention_decode_kprefetch() -> int:
    """A one-token forward's far key fetch distance in keys (``set_attention_decode_kprefetch``; 0: off)."""
    library()
    return int(_state.get("decode_kprefetch", DECODE_KPREFETCH_KEYS))


def set_attention_next_kprefetch(on: bool) -> bool | None:
    """Whether the dense attention on the AVX-512 tiles fetches the next chunk's keys into L2
    during each chunk's P.V phase, while the memory would otherwise idle, where its score loop's
    own fetches reach least far: a decode step (T = 1) and the keys-in-lanes score tiles (a wide
    verify). A speed choice (the same results) that depends on the CPU, which the kernel plan's
    trial measures at load. Returns the setting (None: no kernels)."""
    return _set_switch("next_kprefetch", "ss_set_attention_next_kprefetch", on)


def attention_next_kprefetch() -> bool:
    """Whether the P.V fetches the next chunk's keys (``set_attention_next_kprefetch``)."""
    library()
    return bool(_state.get("next_kprefetch", True))


def set_attention_verify_kprefetch(max_t: int) -> int | None:
    """The widest verify (query positions per row; 0: none, capped at ``CHUNK``) whose P.V in the
    row-pair score tiles also fetches the next chunk's keys into L2 (where
    ``set_attention_next_kprefetch`` is on): a speed choice (the same results) that depends on the
    CPU, which the kernel plan's fetch trial measures at load (``VERIFY_KPREFETCH_T`` or 0). Returns
    the setting (None: no kernels)."""
    return _set_distance("verify_kprefetch", "ss_set_attention_verify_kprefetch", max_t)


def attention_verify_kprefetch() -> int:
    """The widest row-pair verify that fetches the next keys (``set_attention_verify_kprefetch``; 0: none)."""
    library()
    return int(_state.get("verify_kprefetch", VERIFY_KPREFETCH_T))


def attention_kt_vprefetch() -> bool:
    """The keys-in-lanes path's early fetch of value rows (``set_attention_kt_vprefetch``)."""
    library()
    return bool(_state.get("kt_vprefetch", True))


def attention_kt_rows() -> int:
    """The fewest query rows per KV head that run the keys-in-lanes score tiles now (0: none)."""
    library()
    return int(_state.get("attention_kt") or 0) if _state.get("attention_isa") == "avx512" else 0


def set_linear_wide_prefetch(rows: int) -> int | None:
    """How many rows of a weight panel ``linear_packed``'s first row tile fetches ahead where the M
    rows take two or more row tiles (M > 6 on the AVX2 tiles, M > 12 on the AVX-512 one; one tile
    keeps ``LINEAR_WIDE_PREFETCH_ROWS``), capped at ``LINEAR_PREFETCH_MAX``: a speed choice (the
    same results) that the kernel plan's trial measures at load (``LINEAR_WIDE_PREFETCH_ROWS`` or
    ``LINEAR_WIDE_PREFETCH_FAR``). Returns the setting (None: no kernels)."""
    return _set_distance("linear_wide_prefetch", "ss_set_linear_wide_prefetch", rows)


def linear_wide_prefetch() -> int:
    """The packed linear's fetch distance in rows with two or more row tiles (``set_linear_wide_prefetch``)."""
    library()
    return int(_state.get("linear_wide_prefetch", LINEAR_WIDE_PREFETCH_ROWS))


def set_linear_avx512(on: bool) -> str | None:
    """The same switch for ``linear_packed``'s AVX-512 tile (12 rows x two panels; bitwise the AVX2
    tiles' results). Returns ``linear_isa()``."""
    return _set_tiles("linear_isa", on)


def linear_isa() -> str | None:
    """Which tile ``linear_packed`` runs above two rows: ``"avx512"`` or ``"avx2"`` (None: no kernels)."""
    library()
    return _state.get("linear_isa")  # type: ignore[return-value]


def attention_isa() -> str | None:
    """Which attention path the loaded kernels run: ``"avx512-kt"`` (the AVX-512 tiles with the
    keys-in-lanes score tiles for wide rows: ``attention_kt_rows``), ``"avx512"`` (query rows in 16
    lanes, where the build has AVX-512 and ``SPARSESPEC_AVX512`` is not ``0``) or ``"avx2"``; None
    when the kernels are unavailable. The three give bitwise the same results."""
    library()
    isa = _state.get("attention_isa")
    return "avx512-kt" if isa == "avx512" and _state.get("attention_kt") else isa  # type: ignore[return-value]


def library_path() -> str | None:
    library()
    return _state.get("path")  # type: ignore[return-value]


def _reset_for_tests() -> None:
    with _lock:
        _state.clear()


# --------------------------------------------------------------------------- wrappers
def _profiled(name: str):
    """Mark a wrapper's calls as ``ss::<name>`` ranges in ``torch.profiler`` tables (the C calls
    are otherwise invisible to it); a no-op check when no profiler runs."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            if torch.autograd._profiler_enabled():
                with torch.profiler.record_function(f"ss::{name}"):
                    return fn(*args, **kwargs)
            return fn(*args, **kwargs)
        return inner
    return wrap


def supports(t: torch.Tensor) -> bool:
    """Whether ``t`` can go through these kernels (fp32 on the CPU)."""
    return t.dtype == torch.float32 and t.device.type == "cpu"


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


_local = threading.local()


def workspace(numel: int) -> torch.Tensor:
    """A float32 scratch buffer of at least ``numel`` elements, reused by this thread's calls
    (grown when too small; the kernels overwrite what they read)."""
    buf = getattr(_local, "ws", None)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(max(numel, 1 << 16), dtype=torch.float32)
        _local.ws = buf
    return buf


def _rows_out(x: torch.Tensor, N: int, out: torch.Tensor | None, accumulate: bool):
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out is None:
        if accumulate:
            raise ValueError("accumulate needs out")
        out = torch.empty(*x.shape[:-1], N, dtype=x.dtype)
    return x2, out, out.view(x2.shape[0], N)


@_profiled("linear")
def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
           accumulate: bool = False) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for fp32 ``x`` ``[..., K]`` and ``w`` ``[N, K]`` (rows contiguous).

    ``out`` ``[..., N]`` (rows contiguous): written (or, with ``accumulate``, added to: the
    residual add fused) and returned.
    """
    N = w.shape[0]
    x2, out, y2 = _rows_out(x, N, out, accumulate)
    if w.stride(-1) != 1:
        w = w.contiguous()
    library().ss_linear(x2.shape[0], N, x.shape[-1], x2.data_ptr(), x2.stride(0), w.data_ptr(), w.stride(0),
                        _ptr(bias), y2.data_ptr(), y2.stride(0), int(accumulate), torch.get_num_threads())
    return out


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """W ``[N, K]`` fp32 as panels of 16 output columns (``linear_packed``'s layout):
    ``[ceil(N / 16), K, 16]``, zero-padded past N."""
    N, K = w.shape
    lib = library()
    wp = torch.empty(lib.ss_pack_numel(N, K) // (16 * K), K, 16, dtype=torch.float32)
    wc = w if w.stride(-1) == 1 else w.contiguous()
    lib.ss_pack_weight(N, K, wc.data_ptr(), wc.stride(0), wp.data_ptr(), torch.get_num_threads())
    return wp


@_profiled("linear_packed")
def linear_packed(x: torch.Tensor, wp: torch.Tensor, N: int, bias: torch.Tensor | None = None, *,
                  out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """``x @ W.T (+ bias)`` with W ``[N, K]`` given as ``pack_weight(W)``; ``out``/``accumulate``
    as in ``linear``. Each output is one FMA chain over K in order: batch- and width-invariant."""
    x2, out, y2 = _rows_out(x, N, out, accumulate)
    library().ss_linear_packed(x2.shape[0], N, x.shape[-1], x2.data_ptr(), x2.stride(0), wp.data_ptr(), _ptr(bias),
                               y2.data_ptr(), y2.stride(0), int(accumulate), torch.get_num_threads())
    return out


@_profiled("rms_norm")
def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``w * x / sqrt(mean(x^2) + eps)`` over the last dim of fp32 ``x`` ``[..., E]``."""
    E = x.shape[-1]
    x2 = x.reshape(-1, E)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype)
    library().ss_rms_norm(x2.shape[0], E, x2.data_ptr(), x2.stride(0), w.data_ptr(), eps, y.data_ptr(), E,
                          torch.get_num_threads())
    return y


@_profiled("silu_mul")
def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gu`` ``[..., 2I]`` = ``(gate | up)``: ``[..., I]``."""
    I2 = gu.shape[-1]
    g2 = gu.reshape(-1, I2)
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    y = torch.empty(*gu.shape[:-1], I2 // 2, dtype=gu.dtype)
    library().ss_silu_mul(g2.shape[0], I2 // 2, g2.data_ptr(), g2.stride(0), y.data_ptr(), I2 // 2,
                          torch.get_num_threads())
    return y


@_profiled("rope_split")
def rope_split(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, H: int, Hkv: int, D: int):
    """Split ``qkv`` ``[B, T, (H + 2 H_kv) D]`` and rotate q and k: q ``[B, H, T, D]``, k and v
    ``[B, H_kv, T, D]``; ``cos``/``sin`` ``[B, T, D]`` (contiguous)."""
    B, T, _ = qkv.shape
    q2 = qkv.reshape(B * T, -1)
    if q2.stride(-1) != 1:
        q2 = q2.contiguous()
    q = torch.empty(B, H, T, D, dtype=qkv.dtype)
    k = torch.empty(B, Hkv, T, D, dtype=qkv.dtype)
    v = torch.empty(B, Hkv, T, D, dtype=qkv.dtype)
    library().ss_rope_split(B, T, H, Hkv, D, q2.data_ptr(), q2.stride(0), cos.data_ptr(), sin.data_ptr(),
                            q.data_ptr(), k.data_ptr(), v.data_ptr(), torch.get_num_threads())
    return q, k, v


@_profiled("build_index")
def build_index(scores: torch.Tensor, length: int, budget: int, n_sink: int, n_recent: int) -> torch.Tensor:
    """``sparsespec.kv.index.build_index`` in one pass per row (radix select, no sort): the same
    positions wherever the scores have no ties at the cut; of keys tied at the cut, the earliest.

    Args:
        scores: ``[A, H, >= length]`` float64 (last dim contiguous), e.g. ``[L, H_kv, S]``.
        length, budget, n_sink, n_recent: as ``build_index``, with ``budget < length`` and
            ``n_sink + n_recent <= budget``.

    Returns:
        ``[A, H, budget]`` int64, ascending.
    """
    A, H = scores.shape[0], scores.shape[1]
    if scores.dtype != torch.float64 or scores.stride(-1) != 1 or scores.shape[-1] < length:
        raise ValueError(f"scores must be float64 [A, H, >= {length}] with a contiguous last dim")
    if not (0 <= n_sink and 0 <= n_recent and n_sink + n_recent <= budget < length):
        raise ValueError(f"need n_sink + n_recent <= budget < length, got {n_sink} + {n_recent}, {budget}, {length}")
    out = torch.empty(A, H, budget, dtype=torch.int64)
    library().ss_build_index(A, H, scores.data_ptr(), scores.stride(0), scores.stride(1), length, n_sink, n_recent,
                             budget, out.data_ptr(), out.stride(0), out.stride(1), torch.get_num_threads())
    return out


def compact_update(index: torch.Tensor, pos: torch.Tensor, slot: torch.Tensor, n_cur: int, k_row: torch.Tensor,
                   v_row: torch.Tensor, ck_row: torch.Tensor, cv_row: torch.Tensor) -> int:
    """Bring one batch row's compact draft KV up to its new index, copying only what changed.

    The state (``pos``, ``slot``, ``n_cur``) says which cache position each compact slot holds:
    per (layer, KV head), ``pos[l, h, :n_cur]`` ascending with their slots ``slot[l, h, :n_cur]``,
    the slots in use being ``0 .. n_cur - 1``. Afterwards it describes ``index`` (``N`` positions
    per list, slots ``0 .. N - 1``): a position kept keeps its slot (or moves down when the index
    shrank), a new one is copied from the cache into a freed slot. The compact rows are in no
    particular order; attention over them is the same sum in another order.

    Args:
        index: ``[L, H_kv, N]`` int64, ascending and unique per list, each ``< k_row.shape[2]``.
        pos, slot: ``[L, H_kv, >= max(N, n_cur)]`` int32 (last dim contiguous), updated in place.
        n_cur: the positions the state holds now (0: none, e.g. a new request: every row is copied).
        k_row, v_row: ``[L, H_kv, S, D]`` the cache of this batch row (rows of D contiguous).
        ck_row, cv_row: ``[L, H_kv, >= N, D]`` its compact rows (rows of D contiguous), same strides.

    Returns:
        The rows copied (moves included).

    Raises:
        ValueError: mismatched shapes, dtypes or strides. RuntimeError: a thread could not allocate
        its scratch (the state is then partly updated: call again with ``n_cur = 0``).
    """
    L, H, N = index.shape
    D = k_row.shape[-1]
    if index.dtype != torch.int64 or index.stride(-1) != 1:
        raise ValueError("index must be int64 [L, H_kv, N] with a contiguous last dim")
    if pos.dtype != torch.int32 or slot.dtype != torch.int32 or pos.stride() != slot.stride() or pos.stride(-1) != 1:
        raise ValueError("pos and slot must be int32 with the same strides and a contiguous last dim")
    if pos.shape[:2] != (L, H) or pos.shape[-1] < max(N, n_cur) or slot.shape != pos.shape:
        raise ValueError(f"pos/slot {tuple(pos.shape)} cannot hold {max(N, n_cur)} positions of [{L}, {H}] lists")
    for t in (k_row, v_row, ck_row, cv_row):
        if t.dtype != torch.float32 or t.shape[:2] != (L, H) or t.shape[-1] != D or t.stride(-1) != 1 or t.stride(-2) != D:
            raise ValueError("k_row, v_row, ck_row, cv_row must be float32 [L, H_kv, *, D] with rows of D contiguous")
    if k_row.stride() != v_row.stride() or ck_row.stride() != cv_row.stride() or ck_row.shape[2] < N:
        raise ValueError("k_row/v_row and ck_row/cv_row must share strides, and the compact rows hold N")
    if N and (int(index.max()) >= k_row.shape[2] or int(index.min()) < 0):
        raise ValueError(f"index positions must lie in [0, {k_row.shape[2]})")
    got = library().ss_compact_update(L, H, D, index.data_ptr(), index.stride(0), index.stride(1), N, pos.data_ptr(),
                                      slot.data_ptr(), pos.stride(0), pos.stride(1), n_cur, k_row.data_ptr(),
                                      v_row.data_ptr(), k_row.stride(0), k_row.stride(1), ck_row.data_ptr(),
                                      cv_row.data_ptr(), ck_row.stride(0), ck_row.stride(1), torch.get_num_threads())
    if got < 0:
        raise RuntimeError("ss_compact_update: out of memory for its scratch")
    return int(got)


def attention_supported(head_dim: int) -> bool:
    return head_dim % 16 == 0


@_profiled("attention")
def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, starts: torch.Tensor, max_start: int,
              scale: float, rows_out: torch.Tensor | None = None, slots: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a ragged batch: returns out ``[B, T, H * D]``.

    Args:
        q: ``[B, H, T, D]`` contiguous (after RoPE); heads ``kv * G + g`` share KV head ``kv``.
        k_cache, v_cache: ``[B, H_kv, S_max, D]`` one layer's cache (rows of D contiguous), the new
            tokens already written at ``starts[b] .. starts[b] + T - 1``.
        starts: ``[B]`` int64 (CPU), each row's length before this forward.
        max_start: ``max(starts)`` (host int).
        scale: softmax scale.
        rows_out: ``[B, H_kv, W, >= max_start + T]`` float32 (last dim contiguous) or None: the
            attention probabilities of the last W queries, summed over each KV group's query heads,
            zero past each row's keys, in columns ``[0, max_start + T)``.
        slots: ``[B, W]`` int64 or None: query w of row b goes to ``rows_out[b, :, slots[b, w]]``
            (then ``rows_out`` is ``[B, H_kv, R, S]`` with R any number of slots: an importance
            window's ring, ``sparsespec.kv.index.RowsTarget``); None: slot w.
    """
    B, H, T, D = q.shape
    Hkv = k_cache.shape[1]
    G = H // Hkv
    if q.stride(-1) != 1 or not q.is_contiguous():
        q = q.contiguous()
    n_max = max_start + T
    lib = library()
    ws = workspace(lib.ss_attention_workspace(B, Hkv, G, T, D, n_max, 0))
    out = torch.empty(B, T, H * D, dtype=q.dtype)
    sp = None
    if rows_out is not None:
        if rows_out.stride(-1) != 1 or rows_out.dtype != torch.float32:
            raise ValueError("rows_out must be float32 with a contiguous last dimension")
        if slots is None:
            W = rows_out.shape[2]
        else:
            W = slots.shape[1]
            if slots.dtype != torch.int64 or not slots.is_contiguous() or tuple(slots.shape) != (B, W):
                raise ValueError(f"slots must be a contiguous int64 [B, W] tensor, got {tuple(slots.shape)} {slots.dtype}")
            sp = slots.data_ptr()
        S_rows = n_max
        if rows_out.shape[3] < S_rows or W > T:
            raise ValueError(f"rows_out {tuple(rows_out.shape)} cannot hold {W} rows of {S_rows} keys")
        rp, rs = rows_out.data_ptr(), rows_out.stride()
    else:
        W, S_rows, rp, rs = 0, 0, None, (0, 0, 0, 0)
    st = starts if starts.dtype == torch.int64 else starts.long()
    lib.ss_attention(B, Hkv, G, T, D, q.data_ptr(), k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
                     v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1), st.data_ptr(), scale,
                     out.data_ptr(), out.stride(0), out.stride(1), rp, rs[0], rs[1], rs[2], W, S_rows, sp,
                     ws.data_ptr(), n_max, torch.get_num_threads())
    return out


def prefill_attention_supported(head_dim: int) -> bool:
    """Whether ``prefill_attention`` runs here: our kernels load and ``head_dim % 16 == 0`` (it
    runs the AVX-512 tiles where the attention's are on, else the AVX2 ones: the same bits)."""
    return available() and head_dim % 16 == 0


@_profiled("prefill_attention")
def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, starts: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Causal attention of a prefill chunk (hundreds of new tokens per row): returns out
    ``[B, T, H * D]``. Flash attention over blocks of 32 keys (an online softmax; the scores and
    P.V in GEMM tiles), one KV group's query heads x up to ``192 / G`` positions per work item; fp32
    accumulation, equal to causal SDPA up to rounding (not bitwise a decode step: a prompt's
    prefill is shared by every method).

    Args:
        q: ``[B, H, T, D]`` (after RoPE); heads ``kv * G + g`` share KV head ``kv``.
        k_cache, v_cache: ``[B, H_kv, S_max, D]`` one layer's cache (rows of D contiguous), the
            chunk's keys and values already written at ``starts[b] .. starts[b] + T - 1``.
        starts: ``[B]`` int64 (CPU), each row's length before this chunk (rows may differ).
        scale: softmax scale.

    Raises:
        RuntimeError: the kernels do not run it here (``prefill_attention_supported``), or a thread
            could not allocate its scratch.
    """
    B, H, T, D = q.shape
    Hkv = k_cache.shape[1]
    lib = library()
    if lib is None or not prefill_attention_supported(D):
        raise RuntimeError(f"prefill_attention needs our kernels and head_dim % 16 == 0 "
                           f"(head_dim {D}; kernels: {unavailable_reason() or attention_isa()})")
    if not q.is_contiguous():
        q = q.contiguous()
    for c in (k_cache, v_cache):
        if c.stride(-1) != 1 or c.stride(-2) != D:
            raise ValueError("the caches' rows of D must be contiguous")
    st = starts if starts.dtype == torch.int64 else starts.long()
    st = st.contiguous()
    out = torch.empty(B, T, H * D, dtype=q.dtype)
    rc = lib.ss_prefill_attention(B, Hkv, H // Hkv, T, D, q.data_ptr(), k_cache.data_ptr(), k_cache.stride(0),
                                  k_cache.stride(1), v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1),
                                  st.data_ptr(), scale, out.data_ptr(), out.stride(0), out.stride(1),
                                  torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"ss_prefill_attention returned {rc} "
                           f"({'head_dim % 16 != 0' if rc == -1 else 'out of memory for its scratch'})")
    return out


@_profiled("sparse_attention")
def sparse_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index: torch.Tensor,
                     n_valid: torch.Tensor, k_tail: torch.Tensor | None, v_tail: torch.Tensor | None,
                     scale: float) -> torch.Tensor:
    """The draft's attention over indexed cache positions plus its tail: out ``[B, T, H * D]``.

    Args:
        q: ``[B, H, T, D]``; query t is tail slot ``E - T + t``.
        k_cache, v_cache: ``[B, H_kv, S_max, D]`` one layer's dense cache.
        index: ``[B, H_kv, N]`` int32 positions (row b uses its first ``n_valid[b]``).
        n_valid: ``[B]`` int (CPU).
        k_tail, v_tail: ``[B, H_kv, E, D]`` the draft tokens of this phase (E >= T) or None.
        scale: softmax scale.
    """
    B, H, T, D = q.shape
    Hkv, N = index.shape[1], index.shape[2]
    G = H // Hkv
    if not q.is_contiguous():
        q = q.contiguous()
    if index.dtype != torch.int32:
        index = index.to(torch.int32)
    if index.stride(-1) != 1:
        index = index.contiguous()
    nv = n_valid if n_valid.dtype == torch.int64 else n_valid.long()
    E = 0 if k_tail is None else k_tail.shape[2]
    n_max = N + E
    lib = library()
    ws = workspace(lib.ss_attention_workspace(B, Hkv, G, T, D, n_max, 1))
    out = torch.empty(B, T, H * D, dtype=q.dtype)
    if E:
        assert k_tail.stride() == v_tail.stride(), "k_tail and v_tail must share strides"
        kt, vt, tsb, tsh = k_tail.data_ptr(), v_tail.data_ptr(), k_tail.stride(0), k_tail.stride(1)
    else:
        kt = vt = None
        tsb = tsh = 0
    lib.ss_sparse_attention(B, Hkv, G, T, D, q.data_ptr(), k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
                            v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1), index.data_ptr(),
                            index.stride(0), index.stride(1), nv.data_ptr(), kt, vt, tsb, tsh, E, scale,
                            out.data_ptr(), out.stride(0), out.stride(1), ws.data_ptr(), n_max,
                            torch.get_num_threads())
    return out


# --------------------------------------------------------------------------- every layer in one call
class ForwardArgs(ctypes.Structure):
    """``fwd_t`` of the C file (every field 8 bytes, in order): one decode / verify / draft forward's
    decoder layers (``forward_layers``)."""

    _fields_ = [(n, ctypes.c_int64) for n in ("B", "T", "L", "E", "H", "Hkv", "D", "I")] + [
        ("eps", ctypes.c_double), ("scale", ctypes.c_double), ("nthreads", ctypes.c_int64),
        ("h", _PTR), ("cosv", _PTR), ("sinv", _PTR), ("ln_attn", _PTR), ("ln_mlp", _PTR), ("wqkv", _PTR),
        ("bqkv", _PTR), ("wo", _PTR), ("wgu", _PTR), ("wdown", _PTR), ("k", _PTR), ("v", _PTR)] + [
        (n, ctypes.c_int64) for n in ("k_sl", "k_sb", "k_sh", "v_sl", "v_sb", "v_sh")] + [
        ("starts", _PTR), ("kv_pos", _PTR), ("rows", _PTR)] + [
        (n, ctypes.c_int64) for n in ("r_sl", "r_sb", "r_sh", "r_sw", "W")] + [
        ("slots", _PTR), ("sparse", ctypes.c_int64), ("index", _PTR)] + [
        (n, ctypes.c_int64) for n in ("i_sl", "i_sb", "i_sh")] + [
        ("n_valid", _PTR), ("kt", _PTR), ("vt", _PTR)] + [
        (n, ctypes.c_int64) for n in ("t_sl", "t_sb", "t_sh", "E_tail")] + [
        (n, _PTR) for n in ("x", "qkv", "q", "att", "gu", "act", "ws")] + [("n_max", ctypes.c_int64)] + [
        ("feat", _PTR), ("feat_ld", ctypes.c_int64), ("n_feat", ctypes.c_int64), ("feat_layers", _PTR)]


class LayerPointers:
    """The per-layer weight pointer arrays ``forward_layers`` reads (panels of every projection, the
    norms, the qkv bias), built once per model and kept alive with the tensors they point into.

    Raises:
        ValueError: a projection without its panel copy (the plan's linear backend is not ours).
    """

    def __init__(self, model):
        from sparsespec.quant import PANELS_ATTR

        L = len(model.layers)
        arr = ctypes.c_void_p * L

        def panels(name):
            out = []
            for i, layer in enumerate(model.layers):
                wp = getattr(getattr(layer, name), PANELS_ATTR, None)
                if wp is None:
                    raise ValueError(f"layer {i}: {name} has no panel copy")
                out.append(wp)
            return out

        self._keep = {n: panels(n) for n in ("wqkv", "wo", "w_gate_up", "w_down")}
        self.wqkv = arr(*[t.data_ptr() for t in self._keep["wqkv"]])
        self.wo = arr(*[t.data_ptr() for t in self._keep["wo"]])
        self.wgu = arr(*[t.data_ptr() for t in self._keep["w_gate_up"]])
        self.wdown = arr(*[t.data_ptr() for t in self._keep["w_down"]])
        self.ln_attn = arr(*[layer.ln_attn.data_ptr() for layer in model.layers])
        self.ln_mlp = arr(*[layer.ln_mlp.data_ptr() for layer in model.layers])
        biased = model.layers[0].bqkv is not None
        self.bqkv = arr(*[layer.bqkv.data_ptr() for layer in model.layers]) if biased else None


def _addr(arr) -> int | None:
    return None if arr is None else ctypes.addressof(arr)


@_profiled("forward_layers")
def forward_layers(model, ptrs: LayerPointers, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                   k: torch.Tensor, v: torch.Tensor, starts: list[int] | None = None, rows=None,
                   draft=None, features: tuple[torch.Tensor, tuple[int, ...]] | None = None) -> torch.Tensor:
    """Every decoder layer of one forward in one call; ``h`` ``[B, T, E]`` (the embeddings) is
    updated in place into the last layer's output and returned.

    Dense (decode, verify): ``k``, ``v`` the cache ``[L, B, H_kv, S_max, D]`` (row b's T tokens
    written at ``starts[b] ..``); ``rows``: None, ``(buffer [L, B, H_kv, W, S], None)`` or a ring
    target ``(ring [L, B, H_kv, R, S_max], slots [B, W])``.
    Draft (``draft=(index [L, B, H_kv, N] int32, n_valid [B] int64, e)``, T = 1): ``k``, ``v`` the
    dense cache read through the index, the new token's k, v going to tail slot ``e`` of
    ``draft_kv=(kt, vt)`` ``[L, B, H_kv, E_max, D]``... passed as ``draft[3]``, ``draft[4]``.
    ``features=(out [B, T, n * E] float32 contiguous, layer ids (n))``: slot j of ``out`` gets
    the output hidden state of layer ``ids[j]`` (bitwise the per-layer path's).
    """
    cfg = model.cfg
    B, T, E = h.shape
    H, Hkv, D, I = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    f = ForwardArgs()
    f.B, f.T, f.L, f.E, f.H, f.Hkv, f.D, f.I = B, T, len(model.layers), E, H, Hkv, D, I
    f.eps, f.scale, f.nthreads = cfg.rms_norm_eps, model.scale, torch.get_num_threads()
    f.h, f.cosv, f.sinv = h.data_ptr(), cos.data_ptr(), sin.data_ptr()
    f.ln_attn, f.ln_mlp = _addr(ptrs.ln_attn), _addr(ptrs.ln_mlp)
    f.wqkv, f.bqkv, f.wo, f.wgu, f.wdown = (_addr(ptrs.wqkv), _addr(ptrs.bqkv), _addr(ptrs.wo), _addr(ptrs.wgu),
                                           _addr(ptrs.wdown))
    f.k, f.v = k.data_ptr(), v.data_ptr()
    f.k_sl, f.k_sb, f.k_sh = k.stride(0), k.stride(1), k.stride(2)
    f.v_sl, f.v_sb, f.v_sh = v.stride(0), v.stride(1), v.stride(2)
    keep = []
    scratch = [torch.empty(B * T, E), torch.empty(B * T, (H + 2 * Hkv) * D), torch.empty(B, H, T, D),
               torch.empty(B * T, H * D), torch.empty(B * T, 2 * I), torch.empty(B * T, I)]
    f.x, f.qkv, f.q, f.att, f.gu, f.act = [t.data_ptr() for t in scratch]
    lib = library()
    if draft is None:
        st = torch.tensor(starts, dtype=torch.int64)
        keep.append(st)
        f.starts = f.kv_pos = st.data_ptr()
        f.n_max = max(starts) + T
        if rows is not None:
            buf, slots = rows
            f.rows = buf.data_ptr()
            f.r_sl, f.r_sb, f.r_sh, f.r_sw = buf.stride(0), buf.stride(1), buf.stride(2), buf.stride(3)
            if slots is not None:
                keep.append(slots)
                f.slots, f.W = slots.data_ptr(), slots.shape[1]
            else:
                f.W = buf.shape[3]
        ws_n = lib.ss_attention_workspace(B, Hkv, H // Hkv, T, D, f.n_max, 0)
    else:
        index, n_valid, e, kt, vt = draft
        if T != 1 or kt.stride() != vt.stride():
            raise ValueError("the draft forward takes one token per row and a tail with k, v alike")
        nv = n_valid if n_valid.dtype == torch.int64 else n_valid.long()
        pos = torch.full((B,), e, dtype=torch.int64)
        keep += [nv, pos, index]
        f.sparse, f.index = 1, index.data_ptr()
        f.i_sl, f.i_sb, f.i_sh = index.stride(0), index.stride(1), index.stride(2)
        f.n_valid, f.kv_pos = nv.data_ptr(), pos.data_ptr()
        f.kt, f.vt = kt.data_ptr(), vt.data_ptr()
        f.t_sl, f.t_sb, f.t_sh, f.E_tail = kt.stride(0), kt.stride(1), kt.stride(2), e + 1
        f.n_max = index.shape[-1] + e + 1
        ws_n = lib.ss_attention_workspace(B, Hkv, H // Hkv, T, D, f.n_max, 1)
    if features is not None:
        out, ids = features
        if out.dtype != torch.float32 or not out.is_contiguous() or tuple(out.shape) != (B, T, len(ids) * E):
            raise ValueError(f"features: a contiguous float32 [{B}, {T}, {len(ids) * E}] buffer expected")
        lay = torch.tensor(ids, dtype=torch.int64)
        keep.append(lay)
        f.feat, f.feat_ld, f.n_feat, f.feat_layers = out.data_ptr(), len(ids) * E, len(ids), lay.data_ptr()
    f.ws = workspace(ws_n).data_ptr()
    lib.ss_forward_layers(ctypes.byref(f))
    return h
