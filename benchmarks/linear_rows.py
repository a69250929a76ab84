"""Our packed linear per row count M, the AVX-512 tile against the AVX2 tiles, side by side.

A decode step's linears read every weight once per step whatever M (the batch's query rows: B for
AR, B (k + 1) for a verify), so at small M they should run at the machine's read bandwidth. This
times one model shape's linears (every layer's q|k|v, o, gate|up and down projections, random
values, packed as the engine packs them) at each M, with the AVX-512 tile on and off in turn in
one process (the order alternating every repetition), checks that both give the same bits, and
prints ms and GB/s per M. The kernel plan (``sparsespec.kernels.plan``) makes this choice at load
from its own trial; this is the per-M view of it. CPU only, needs our kernels::

    python benchmarks/linear_rows.py --shape smollm2-135m --rows 1,2,3,4,8 --threads 2

``--resident MB`` times instead one weight of about that many MB (rows of the model's hidden
size), small enough to stay in the last-level cache across repetitions: the tile's compute rate,
which the host's memory state does not move (streamed from memory, a tile whose compute rate is
not well above the read rate overlaps badly with it; on the AMD EPYC of benchmarks/RESULTS.md the
host's read swings between ~30 and ~66 GB/s within minutes)::

    python benchmarks/linear_rows.py --rows 1,2,4,8,12 --threads 2 --resident 16
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--rows", default="1,2,3,4,5,8")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--resident", type=float, default=0.0,
                    help="time one weight of about this many MB (cache-resident) instead of the model's")
    args = ap.parse_args(argv)
    if args.resident < 0:
        ap.error(f"--resident must be >= 0 MB, got {args.resident}")
    if args.threads:
        torch.set_num_threads(args.threads)
    from sparsespec.kernels import cpu
    from sparsespec.shapes import get_shape

    if not cpu.available():
        print(f"linear_rows: our CPU kernels are unavailable: {cpu.unavailable_reason()}", file=sys.stderr)
        return 1
    before = cpu.linear_isa()  # put back at the end
    tiles = ("avx512", "avx2") if cpu.set_linear_avx512(True) == "avx512" else ("avx2",)
    cfg = get_shape(args.shape)
    E, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes = [((cfg.num_heads + 2 * cfg.num_kv_heads) * D, E), (E, cfg.num_heads * D), (2 * I, E), (E, I)]
    g = torch.Generator().manual_seed(0)
    if args.resident:  # one weight of E columns, 16-row panels, about --resident MB
        N = max(16, int(args.resident * 1e6 / (4 * E)) // 16 * 16)
        shapes, layers, what = [(N, E)], 1, f"one {N} x {E} weight, cache-resident"
    else:
        layers, what = cfg.num_layers, "every layer's linears, streamed"
    weights = [(N, cpu.pack_weight(torch.randn(N, K, generator=g))) for _ in range(layers) for N, K in shapes]
    if args.resident:  # the same weight over and over: each repetition reads ~400 MB, as the streamed one does
        weights = weights * max(1, int(400e6 / (weights[0][1].numel() * 4)))
    nbytes = sum(wp.numel() * wp.element_size() for _, wp in weights)
    print(f"{cpu.cpu_model()} [{cpu.isa_summary()}] · {torch.get_num_threads()} threads · {args.shape}: "
          f"{len(weights)} linear calls, {nbytes / 1e6:.1f} MB read ({what})")
    print("| M | " + " | ".join(f"{t} ms | {t} GB/s" for t in tiles) + " | same bits |")
    print("|---|" + "---|---|" * len(tiles) + "---|")
    try:
        for M in (int(m) for m in args.rows.split(",")):
            xs = {K: torch.randn(M, K, generator=g) for K in {E, cfg.num_heads * D, I}}
            times: dict[str, list[float]] = {t: [] for t in tiles}
            outs: dict[str, list[torch.Tensor]] = {}
            for rep in range(args.reps):
                for t in (tiles if rep % 2 == 0 else tiles[::-1]):
                    cpu.set_linear_avx512(t == "avx512")
                    ys = []
                    t0 = time.perf_counter()
                    for N, wp in weights:
                        ys.append(cpu.linear_packed(xs[wp.shape[1]], wp, N))
                    times[t].append(time.perf_counter() - t0)
                    outs[t] = ys
            same = all(torch.equal(a, b) for a, b in zip(outs[tiles[0]], outs[tiles[-1]]))
            cells = []
            for t in tiles:
                s = statistics.median(times[t][1:])
                cells.append(f"{s * 1e3:.2f} | {nbytes / s / 1e9:.3g}")
            print(f"| {M} | " + " | ".join(cells) + f" | {same} |", flush=True)
    finally:
        cpu.set_linear_avx512(before == "avx512")
    return 0


if __name__ == "__main__":
    sys.exit(main())
