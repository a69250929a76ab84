"""Triton kernels for decode/verify attention with importance, and sparse draft attention.

Imported only when the Triton path is used (``sparsespec.kernels.use_triton``), so that importing
the engine never imports triton, and so that ``TRITON_INTERPRET=1`` set by a test before the first
import takes effect (triton reads it when the kernels are decorated).

Sources followed:

* FlashAttention-2 (Dao 2023, arXiv:2307.08691), Algorithm 1: online softmax over key blocks with
  a running max ``m`` and sum ``l``, rescaling the fp32 accumulator by ``exp(m_old - m_new)``, and
  the log-sum-exp ``lse = m + log l`` kept for a later pass. Scores are computed in base 2
  (``exp2``, scale folded with ``log2 e``) as in the Triton tutorial "Fused Attention".
* Flash-Decoding (Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context inference"):
  with few queries, parallelism comes from splitting the keys into chunks (split-K); each chunk
  writes a normalised partial output and its lse, and a small reduction kernel combines them with
  weights ``exp(lse_i - lse)``.
* GQA grouping (as in FlashDecoding++/FlashInfer decode kernels): the G query heads of one KV head
  (times the T new tokens) form the M dimension of one program, so each KV byte is read once per
  forward for all heads that use it.
* Importance rows: re-materialise probabilities from the lse (the FlashAttention-2 backward
  recomputes ``P = exp(S - lse)`` the same way) in a second pass that reads K only, for the last W
  queries, summing the G heads of a KV head in registers before the single fp32 store.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _online_update(q, k, v, visible, m_i, l_i, acc, qk_scale, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """One key block of the online softmax. q ``[M, D]``, k/v ``[N, D]``, visible ``[M, N]``;
    m_i/l_i ``[M]`` in base-2 units, acc ``[M, D]`` fp32.

    UPCAST: dot operands to fp32 first. Only for bfloat16 under the CPU interpreter, whose ``tl.dot``
    mishandles bf16 (stored as uint16); on GPUs bf16/fp16 go to the tensor cores with fp32
    accumulation, and fp32 uses ``PREC="tf32x3"`` (about fp32 accuracy, not plain TF32).
    """
    if UPCAST:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
    s = tl.where(visible, s * qk_scale, float("-inf"))  # [M, N] fp32, log2 units
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays empty
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if UPCAST:
        pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision=PREC)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


# Per-step sizes are runtime arguments without value specialisation (do_not_specialize): T (1..17),
# W, the index width and the tail length change from step to step and must not each compile a new
# variant; only the block sizes (powers of two) and flags are compile-time constants.
@triton.jit(do_not_specialize=["n_index", "n_tail", "T"])
def _attn_fwd(
    Q, K, V, IDX, NVALID, STARTS, KT, VT, O, LSE, OP, LSEP,
    sqb, sqh, sqt, sqd,
    skb, skh, sks, skd,
    svb, svh, svs, svd,
    sib, sih, sin_,
    stb, sth, sts, std_,
    sub, suh, sus, sud,
    sob, soh, sot, sod,
    n_index, n_tail, keys_per_split, n_splits, qk_scale, T,
    H_KV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
    GATHER: tl.constexpr, HAS_NVALID: tl.constexpr, HAS_TAIL: tl.constexpr, SPLIT: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """Program (b * H_kv + kv, split): the G*T query rows of one KV head over one key chunk.

    GATHER: keys are ``IDX[b, kv, n]`` positions of the dense cache (all visible), plus (split 0)
    the draft tail with its causal rule. Else: keys are cache positions ``0 .. starts[b] + T - 1``,
    row (g, t) sees positions ``<= starts[b] + t``.
    """
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid // H_KV).to(tl.int64)  # 64-bit offsets: b * stride can pass 2^31 on long caches
    kvh = pid % H_KV
    offs_m = tl.arange(0, BLOCK_M)
    g = offs_m // T
    t = offs_m % T
    row_ok = offs_m < G * T
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    h = kvh * G + g
    q = tl.load(Q + b * sqb + h[:, None] * sqh + t[:, None] * sqt + offs_d[None, :] * sqd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = K + b * skb + kvh * skh
    v_base = V + b * svb + kvh * svh
    if GATHER:
        n_b = n_index
        if HAS_NVALID:
            n_b = tl.minimum(tl.load(NVALID + b).to(tl.int32), n_index)
        qpos = tl.zeros([BLOCK_M], tl.int32)  # unused: every indexed key is visible
    else:
        start = tl.load(STARTS + b).to(tl.int32)
        n_b = start + T
        qpos = start + t
    lo = split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, n_b)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        if GATHER:
            pos = tl.load(IDX + b * sib + kvh * sih + offs_n * sin_, mask=n_ok, other=0).to(tl.int64)
            visible = n_ok[None, :] & row_ok[:, None]
        else:
            pos = offs_n.to(tl.int64)
            visible = n_ok[None, :] & (offs_n[None, :] <= qpos[:, None])
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + pos[:, None] * sks + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
        v = tl.load(v_base + pos[:, None] * svs + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
        m_i, l_i, acc = _online_update(q, k, v, visible, m_i, l_i, acc, qk_scale, PREC, UPCAST)
    if HAS_TAIL:
        if split == 0:
            # fresh names only: a runtime `if` yields the names it rebinds, which must keep their types
            offs_e = tl.arange(0, BLOCK_E)
            e_ok = offs_e < n_tail
            tail_mask = e_ok[:, None] & d_ok[None, :]
            kt = tl.load(KT + b * stb + kvh * sth + offs_e[:, None] * sts + offs_d[None, :] * std_, mask=tail_mask,
                         other=0.0)
            vt = tl.load(VT + b * sub + kvh * suh + offs_e[:, None] * sus + offs_d[None, :] * sud, mask=tail_mask,
                         other=0.0)
            tail_visible = e_ok[None, :] & (offs_e[None, :] <= (n_tail - T + t)[:, None])
            m_i, l_i, acc = _online_update(q, kt, vt, tail_visible, m_i, l_i, acc, qk_scale, PREC, UPCAST)
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))  # log2 units
    r = (b * (H_KV * G) + h) * T + t  # row of [B, H, T]
    if SPLIT:
        tl.store(OP + (r[:, None] * n_splits + split) * D + offs_d[None, :], out, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(LSEP + r * n_splits + split, lse, mask=row_ok)
    else:
        tl.store(O + b * sob + h[:, None] * soh + t[:, None] * sot + offs_d[None, :] * sod,
                 out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        tl.store(LSE + r, lse, mask=row_ok)


@triton.jit(do_not_specialize=["T"])
def _combine(OP, LSEP, O, LSE, sob, soh, sot, sod, n_splits, T,
             H: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program r (one query row of [B, H, T]): merge the split partials (flash-decoding reduction)."""
    r = tl.program_id(0)
    b = r // (H * T)
    h = (r // T) % H
    t = r % T
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < n_splits
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    lse_s = tl.load(LSEP + r * n_splits + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse_s - m)  # empty splits weigh 0
    denom = tl.sum(w, 0)
    part = tl.load(OP + (r * n_splits + offs_s[:, None]) * D + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                   other=0.0)
    out = tl.sum(w[:, None] * part, 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(O + b * sob + h * soh + t * sot + offs_d * sod, out.to(O.dtype.element_ty), mask=d_ok)
    tl.store(LSE + r, tl.where(denom == 0.0, float("-inf"), m + tl.log2(tl.where(denom == 0.0, 1.0, denom))))


@triton.jit(do_not_specialize=["s_out", "T", "W"])
def _importance(
    Q, K, LSE, STARTS, ROWS,
    sqb, sqh, sqt, sqd,
    skb, skh, sks, skd,
    srb, srh, srw, srs,
    s_out, keys_per_split, qk_scale, T, W,
    H_KV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
    BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Program (b * H_kv + kv, split): rows[b, kv, w, s] = sum_g exp(score - lse) for one key chunk.

    Reads K once per chunk for the G heads; writes every position ``< s_out`` (zero where the key
    is past the query's position, including a short row's unused tail).
    """
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid // H_KV).to(tl.int64)  # 64-bit offsets: b * stride can pass 2^31 on long caches
    kvh = pid % H_KV
    start = tl.load(STARTS + b).to(tl.int32)
    n_b = start + T
    offs_w = tl.arange(0, BLOCK_W)
    w_ok = offs_w < W
    t = T - W + offs_w
    qpos = start + t
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    lo = split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, s_out)
    k_base = K + b * skb + kvh * skh
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_in = offs_n < hi
        n_ok = n_in & (offs_n < n_b)
        k = tl.load(k_base + offs_n[:, None].to(tl.int64) * sks + offs_d[None, :] * skd,
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        visible = n_ok[None, :] & w_ok[:, None] & (offs_n[None, :] <= qpos[:, None])
        acc = tl.zeros([BLOCK_W, BLOCK_N], tl.float32)
        for g in tl.static_range(G):
            h = kvh * G + g
            qg = tl.load(Q + b * sqb + h * sqh + t[:, None] * sqt + offs_d[None, :] * sqd,
                         mask=w_ok[:, None] & d_ok[None, :], other=0.0)
            lse = tl.load(LSE + (b * (H_KV * G) + h) * T + t, mask=w_ok, other=0.0)
            if UPCAST:  # see _online_update
                s = tl.dot(qg.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * qk_scale
            else:
                s = tl.dot(qg, tl.trans(k), input_precision=PREC) * qk_scale
            acc += tl.exp2(tl.where(visible, s - lse[:, None], float("-inf")))
        tl.store(ROWS + b * srb + kvh * srh + offs_w[:, None] * srw + offs_n[None, :] * srs, acc,
                 mask=w_ok[:, None] & n_in[None, :])


# ---------------------------------------------------------------------------------------- launchers
def _pow2(x: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(int(x)))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _plan_splits(n_keys: int, programs: int, block_n: int, device: torch.device, num_splits: int | None,
                 min_blocks: int = 2) -> tuple[int, int]:
    """(splits, keys per split): about 2 programs per SM on CUDA, one split elsewhere (interpreter)."""
    blocks = max(1, triton.cdiv(max(n_keys, 1), block_n))
    if num_splits is None:
        if device.type == "cuda":
            target = 2 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
            num_splits = min(triton.cdiv(target, programs), triton.cdiv(blocks, min_blocks))
        else:
            num_splits = 1
    num_splits = max(1, min(int(num_splits), blocks))
    per = triton.cdiv(blocks, num_splits) * block_n
    return triton.cdiv(max(n_keys, 1), per), per


def _meta(q: torch.Tensor, num_warps: int) -> dict:
    fp32 = q.dtype == torch.float32
    upcast = q.device.type != "cuda" and q.dtype == torch.bfloat16  # interpreter: see _online_update
    # fp32: "tf32x3" (three TF32 tensor-core products, about fp32 accuracy); "ieee" FMA dots at
    # these tile sizes spill thousands of bytes per thread and take ~40 s each to compile
    prec = ("tf32x3" if q.device.type == "cuda" else "ieee") if fp32 else "tf32"
    return dict(PREC=prec, UPCAST=upcast, num_warps=num_warps)


# Launch configurations, measured on an H200 (Triton 3.6, CUDA 13; benchmarks/kernel_configs.py,
# Llama-3.1-8B heads, 2 rows x 16000 keys; benchmarks/RESULTS.md, 2026-12-04), chosen among those
# that compiled without spills on sm_90 (registers, shared memory):
#   bf16 _attn_fwd  M=16 (decode/draft, G*T <= 16): BLOCK_N=64, 4 warps, 2 stages
#   bf16 _attn_fwd  M=32..128 (verify):             BLOCK_N=32, 8 warps, 2 stages (T=9: 465 us
#                                                   against 569 at BLOCK_N=64; T=17: 351 against 600)
#   _importance (W <= 16):                          BLOCK_N=64, 8 warps
#   fp32 ("tf32x3" dots; the lossless tests): M=16 BLOCK_N=16 8 warps; M=32..64 BLOCK_N=32 4 warps;
#   M=128 BLOCK_N=32 8 warps; 1 stage. BLOCK_N=16 with 8 warps at M=64 faults the device
#   (illegal address) under Triton 3.6, and BLOCK_N=64 with 2 stages at M=128 needs 256 KB of
#   shared memory (232 KB on sm_90).
def _fwd_config(block_m: int, block_d: int, fp32: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of ``_attn_fwd``."""
    if fp32:
        if block_m <= 16:
            return 16, 8, 1
        return (32, 4, 1) if block_m <= 64 else (32, 8, 1)
    if block_m <= 16:
        return (64 if block_d <= 128 else 32), 4, 2
    return 32, 8, 2


def _launch_fwd(q, k_cache, v_cache, *, index, n_valid, starts, k_tail, v_tail, n_keys, scale, num_splits, block_n):
    """Shared launcher of ``_attn_fwd`` (+ ``_combine``); returns out ``[B, H, T, D]`` and lse ``[B, H, T]``
    (natural log, float32)."""
    B, H, T, D = q.shape
    Hkv = k_cache.shape[1]
    G = H // Hkv
    dev = q.device
    BLOCK_M, BLOCK_D = _pow2(G * T), _pow2(D)
    default_n, num_warps, num_stages = _fwd_config(BLOCK_M, BLOCK_D, q.dtype == torch.float32 and dev.type == "cuda")
    block_n = block_n or default_n
    splits, per = _plan_splits(n_keys, B * Hkv, block_n, dev, num_splits)
    out = torch.empty(B, T, H, D, dtype=q.dtype, device=dev).transpose(1, 2)  # [B, H, T, D], heads-last memory
    lse = torch.empty(B * H * T, dtype=torch.float32, device=dev)
    split = splits > 1
    if split:
        op = torch.empty(B * H * T, splits, D, dtype=torch.float32, device=dev)
        lsep = torch.empty(B * H * T, splits, dtype=torch.float32, device=dev)
    else:
        op, lsep = lse, lse  # unused
    gather = index is not None
    has_tail = k_tail is not None and k_tail.shape[2] > 0
    E = k_tail.shape[2] if has_tail else 0
    idx = index if gather else starts
    kt, vt = (k_tail, v_tail) if has_tail else (q, q)
    sidx = index.stride() if gather else (0, 0, 0)
    meta = _meta(q, num_warps)
    _attn_fwd[(B * Hkv, splits)](
        q, k_cache, v_cache, idx, n_valid if n_valid is not None else idx, starts if starts is not None else idx,
        kt, vt, out, lse, op, lsep,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *sidx,
        *(kt.stride() if has_tail else (0, 0, 0, 0)), *(vt.stride() if has_tail else (0, 0, 0, 0)),
        *out.stride(),
        index.shape[2] if gather else 0, E, per, splits, scale * LOG2E, T,
        H_KV=Hkv, G=G, D=D, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_D=BLOCK_D, BLOCK_E=_pow2(E),
        GATHER=gather, HAS_NVALID=n_valid is not None, HAS_TAIL=has_tail, SPLIT=split,
        num_stages=num_stages, **meta,
    )
    if split:
        _combine[(B * H * T,)](op, lsep, out, lse, *out.stride(), splits, T, H=H, D=D, BLOCK_S=_pow2(splits, 2),
                               BLOCK_D=BLOCK_D, num_warps=4)
    return out, lse.view(B, H, T)


def verify_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, starts: torch.Tensor,
                            want_rows: int, scale: float, max_start: int | None = None, *,
                            num_splits: int | None = None, block_n: int | None = None, return_lse: bool = False,
                            rows_out: torch.Tensor | None = None):
    """Triton version of ``reference.verify_attention_ref`` (same arguments and results).

    Pass 1 (``_attn_fwd`` + ``_combine``): output and lse of the T queries, split-K over the keys.
    Pass 2 (``_importance``, only if ``want_rows``): rows ``[B, H_kv, W, max_start + T]`` float32.
    ``rows_out``: a float32 buffer of that shape (any strides) to write the rows into.
    ``num_splits`` / ``block_n`` override the launch plan (tests).
    """
    B, H, T, D = q.shape
    Hkv = k_cache.shape[1]
    W = int(want_rows)
    if not 0 <= W <= T:
        raise ValueError(f"want_rows must be in [0, T={T}], got {W}")
    if max_start is None:
        max_start = int(starts.max())
    S = max_start + T
    if S > k_cache.shape[2]:
        raise ValueError(f"cache capacity {k_cache.shape[2]} < {S} positions")
    starts = starts.to(device=q.device, dtype=torch.int32)
    out, lse = _launch_fwd(q, k_cache, v_cache, index=None, n_valid=None, starts=starts, k_tail=None, v_tail=None,
                           n_keys=S, scale=scale, num_splits=num_splits, block_n=block_n)
    rows = None
    if W:
        G = H // Hkv
        BLOCK_W, BLOCK_D = _pow2(W), _pow2(D)
        bn = block_n or (64 if BLOCK_D <= 128 else 32)
        splits, per = _plan_splits(S, B * Hkv, bn, q.device, num_splits, min_blocks=4)
        rows = torch.empty(B, Hkv, W, S, dtype=torch.float32, device=q.device) if rows_out is None else rows_out
        if tuple(rows.shape) != (B, Hkv, W, S) or rows.dtype != torch.float32:
            raise ValueError(f"rows_out must be float32 {(B, Hkv, W, S)}, got {rows.dtype} {tuple(rows.shape)}")
        _importance[(B * Hkv, splits)](
            q, k_cache, lse, starts, rows, *q.stride(), *k_cache.stride(), *rows.stride(),
            S, per, scale * LOG2E, T, W,
            H_KV=Hkv, G=G, D=D, BLOCK_W=BLOCK_W, BLOCK_N=bn, BLOCK_D=BLOCK_D, num_stages=2,
            **_meta(q, 8),
        )
    if return_lse:
        return out, rows, lse * LN2
    return out, rows


def sparse_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index: torch.Tensor,
                            n_valid: torch.Tensor | None, k_tail: torch.Tensor | None, v_tail: torch.Tensor | None,
                            scale: float, *, num_splits: int | None = None, block_n: int | None = None) -> torch.Tensor:
    """Triton version of ``reference.sparse_attention_ref`` (same arguments and result); the
    indexed keys are gathered inside the kernel, split-K over the index."""
    if n_valid is not None:
        n_valid = n_valid.to(device=q.device, dtype=torch.int32)
    out, _ = _launch_fwd(q, k_cache, v_cache, index=index, n_valid=n_valid, starts=None, k_tail=k_tail,
                         v_tail=v_tail, n_keys=index.shape[2], scale=scale, num_splits=num_splits, block_n=block_n)
    return out
