"""One layer's dense attention kernel on the CPU (``sparsespec.kernels.cpu.attention``) against
its roofline, at decode (T = 1) and verify widths (T = k + 1), with and without importance rows.

Shape: SmolLM2-135M's attention (H = 9, H_kv = 3, D = 64) by default, batch B x context S, fp32,
random K/V/q (timing only). Each width is timed ``--reps`` times, the widths interleaved in one
loop (a slow moment lands on every width alike); the median is reported. The roofline is
max(K and V bytes / measured read bandwidth, FLOPs / measured GEMM rate), both measured at the
start (``sparsespec.roofline.measure_machine``); FLOPs = 4 x B x H x T x S x D (QK^T and PV).
A verify step's attention reads the same bytes as a decode step's, so at T > 1 the kernel turns
compute-bound on a CPU whose GEMM rate per byte of bandwidth is low: the ``GFLOP/s`` column
against the GEMM rate says how far its score and P.V phases are from a GEMM's efficiency.

Each timed call runs the kernel over ``--layers`` layers' own K and V (SmolLM2's 30 by default:
1.1 GB at the default 4 x 6K), one after the other as a step does, and the times are per layer:
the caches stream from memory as in a step. ``--layers 1`` re-reads one layer's 37.7 MB every
call: on a CPU with a large last-level cache (480 MB on the Xeon of benchmarks/RESULTS.md) that
times the kernel from cache, 1.3-3x faster than inside a step. Compare with
``python -m cluster.speed --steps-only`` (the attention phase of whole steps).

    .venv/bin/python benchmarks/attention_cpu.py --batch 4 --context 6144 --widths 1,3,9 --tiles avx512-kt,avx512,avx2
    .venv/bin/python benchmarks/attention_cpu.py --batch 8 --context 8192 --widths 1,3 --fetch 16/32,0/32,16/0,0/0
    .venv/bin/python benchmarks/attention_cpu.py --batch 4 --context 6144 --widths 1,3 --fetch 16/32/1,16/32/0

``--fetch PV/DK[/NK[/VK]],...`` times the prefetches side by side (the same bits): PV, the keys ahead
whose value rows the P.V phase fetches (``cpu.set_attention_pv_prefetch``), DK, the keys ahead a
one-token forward's scores fetch into L2 (``cpu.set_attention_decode_kprefetch``), NK (1 or 0;
default: the current setting), whether the P.V of a decode step and of the keys-in-lanes tiles
fetches the next chunk's keys into L2 (``cpu.set_attention_next_kprefetch``), VK (default: the current
setting), the widest verify in the row-pair tiles whose P.V does too (``cpu.set_attention_verify_kprefetch``;
0: none); the kernel plan chooses all four at load.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=6144)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--widths", default="1,3,9", help="query tokens per row (verify: k + 1)")
    ap.add_argument("--layers", type=int, default=30, help="layers of K/V each call runs over (times: per layer)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tiles", default=None,
                    help="comma-separated attention tiles to time side by side (avx512-kt, avx512-kt-late: the "
                         "value rows fetched late, avx512, avx2; "
                         "bitwise the same results); default: what the library runs now")
    ap.add_argument("--fetch", default=None,
                    help="comma-separated PV/DK[/NK[/VK]] prefetches to time side by side (PV, DK: distances in "
                         "keys; NK: 1 or 0; VK: a verify width; e.g. 16/32,0/0,16/32/0,16/32/1/0); "
                         "default: what the library runs now")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from sparsespec.kernels import cpu as kc
    from sparsespec.roofline import measure_machine

    if not kc.available():
        print(f"attention_cpu: our CPU kernels are unavailable here: {kc.unavailable_reason()}")
        return 1
    B, H, Hkv, D, S = a.batch, a.heads, a.kv_heads, a.head_dim, a.context
    # every argument is checked before the machine is measured (seconds): a bad one costs nothing
    try:
        widths = [int(x) for x in a.widths.split(",")]
    except ValueError:
        ap.error(f"--widths: expected comma-separated integers, got {a.widths!r}")
    L = a.layers
    if L < 1:
        ap.error("--layers must be at least 1")
    tiles = a.tiles.split(",") if a.tiles else [kc.attention_isa()]
    bad = [t for t in tiles if t not in ("avx512-kt", "avx512-kt-late", "avx512", "avx2")]
    if bad:
        ap.error(f"--tiles: unknown {bad} (avx512-kt, avx512-kt-late, avx512, avx2)")

    now = (kc.attention_pv_prefetch(), kc.attention_decode_kprefetch(), int(kc.attention_next_kprefetch()),
           kc.attention_verify_kprefetch())
    try:
        fetches = [tuple(int(x) for x in f.split("/")) for f in a.fetch.split(",")] if a.fetch else [now]
    except ValueError:
        ap.error(f"--fetch: expected PV/DK, PV/DK/NK or PV/DK/NK/VK integers, e.g. 16/32,0/0,16/32/0, got {a.fetch!r}")
    fetches = [f + now[len(f):] if 2 <= len(f) < 4 else f for f in fetches]
    if any(len(f) != 4 or min(f) < 0 or max(f) > kc.CHUNK or f[2] > 1 for f in fetches):
        ap.error(f"--fetch: each PV/DK/VK in [0, {kc.CHUNK}] and NK 0 or 1, got {a.fetch!r}")
    machine = measure_machine("cpu", torch.float32, reps=3)
    bw, gemm = machine["read_bytes_per_s"], machine["gemm_flops_per_s"]
    k = torch.randn(L, B, Hkv, S + max(widths), D)  # every layer's own cache, as in a step
    v = torch.randn_like(k)
    starts = torch.full((B,), S, dtype=torch.int64)

    def use(tile, fetch):
        kc.set_attention_pv_prefetch(fetch[0])
        kc.set_attention_decode_kprefetch(fetch[1])
        kc.set_attention_next_kprefetch(bool(fetch[2]))
        kc.set_attention_verify_kprefetch(fetch[3])
        kc.set_attention_avx512(tile != "avx2")
        kc.set_attention_kt_vprefetch(tile != "avx512-kt-late")
        if kc.set_attention_kt(1 if tile.startswith("avx512-kt") else 0) != tile.removesuffix("-late"):
            raise SystemExit(f"attention_cpu: tiles {tile!r} are not available in this build ({kc.attention_isa()})")

    calls = {}
    for T in widths:
        q = torch.randn(B, H, T, D)
        for tile in tiles:
            for fetch in fetches:
                def run(q=q, rows=None, tile=tile, fetch=fetch):
                    use(tile, fetch)
                    for i in range(L):
                        kc.attention(q, k[i], v[i], starts, S, D ** -0.5, rows_out=rows)

                calls[(T, False, tile, fetch)] = run
                if T > 1:
                    rows = torch.zeros(B, Hkv, T, S + T)
                    calls[(T, True, tile, fetch)] = (lambda run=run, rows=rows: run(rows=rows))
    times: dict = {key: [] for key in calls}
    tiles_now = (kc.attention_isa() == "avx512", kc.attention_kt_rows(), kc.attention_kt_vprefetch())
    try:
        for f in calls.values():
            f()
        for rep in range(a.reps):
            for key, f in (calls.items() if rep % 2 == 0 else reversed(calls.items())):  # neither order favoured
                t0 = time.perf_counter()
                f()
                times[key].append((time.perf_counter() - t0) / L)
    finally:  # the library's settings as they were, also after an error
        kc.set_attention_pv_prefetch(now[0])
        kc.set_attention_decode_kprefetch(now[1])
        kc.set_attention_next_kprefetch(bool(now[2]))
        kc.set_attention_verify_kprefetch(now[3])
        kc.set_attention_avx512(tiles_now[0])
        kc.set_attention_kt(tiles_now[1])
        kc.set_attention_kt_vprefetch(tiles_now[2])
    print(f"{kc.cpu_model()} [{kc.isa_summary()}], {torch.get_num_threads()} threads; read {bw / 1e9:.1f} GB/s, "
          f"GEMM {gemm / 1e9:.0f} GFLOP/s ({machine['gemm_backend']}); B={B} S={S} H={H} H_kv={Hkv} D={D}, {L} layer(s) per call, "
          f"times per layer\n")
    print("| T | rows | tiles | fetch PV/DK/NK/VK | ms | x roofline | GB/s (K+V) | GFLOP/s |")
    print("|---|---|---|---|---|---|---|---|")
    kv_bytes = 2 * B * Hkv * S * D * 4
    for (T, rows, tile, fetch), ts in times.items():
        t = statistics.median(ts)
        flops = 4 * B * H * T * S * D
        roof = max(kv_bytes / bw, flops / gemm)
        print(f"| {T} | {'yes' if rows else 'no'} | {tile} | {'/'.join(map(str, fetch))} | {t * 1e3:.3f} | "
              f"{t / roof:.2f} | "
              f"{kv_bytes / t / 1e9:.1f} | "
              f"{flops / t / 1e9:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
