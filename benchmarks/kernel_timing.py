"""Per-layer attention kernel timings on a GPU, against the bytes they must move.

One layer of a model shape (default Llama-3.1-8B: H=32, H_kv=8, D=128), batch 1, bf16, at each
context length: dense decode (T=1), verify (T=K+1) with and without importance rows, and the
sparse draft step at a budget fraction; Triton kernel vs the PyTorch path on the same GPU. Each
time is ``triton.testing.do_bench`` (L2 flushed between runs, median). The bandwidth reference
is a device-to-device copy measured in the same run; ``x_roofline`` = time / (bytes / bandwidth),
with bytes = the K and V bytes the step must read (plus the rows it writes).

    python benchmarks/kernel_timing.py --json-out gpu_out/kernels.json
"""
from __future__ import annotations

import argparse
import json
import sys

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--context-lengths", default="16384,32768,65536")
    ap.add_argument("--k", type=int, default=8, help="draft length: verify has T = k + 1 queries")
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--budget-frac", type=float, default=0.1)
    ap.add_argument("--graphs", action="store_true",
                    help="also time each case as a CUDA graph replay (device time without Python launch costs)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_timing: no CUDA device", file=sys.stderr)
        return 1
    import triton.testing

    from sparsespec import kernels
    from sparsespec.shapes import get_shape

    cfg = get_shape(args.shape)
    dtype = getattr(torch, args.dtype)
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    esize = torch.tensor([], dtype=dtype).element_size()
    scale = D**-0.5
    dev = "cuda"

    def bench(fn) -> float:
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")) * 1e-3  # seconds

    buf = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    out_buf = torch.empty_like(buf)
    bw = 2 * buf.numel() / bench(lambda: out_buf.copy_(buf))  # read + write bytes per second
    del buf, out_buf
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e9:.0f} GB/s")
    results = {"device": torch.cuda.get_device_name(), "shape": args.shape, "dtype": args.dtype,
               "copy_bandwidth_Bps": bw, "rows": []}
    T = args.k + 1
    W = min(args.window, T)
    for S in [int(x) for x in args.context_lengths.split(",")]:
        g = torch.Generator(device=dev).manual_seed(S)
        kc = torch.randn(1, Hkv, S + 64, D, device=dev, dtype=dtype, generator=g)
        vc = torch.randn(1, Hkv, S + 64, D, device=dev, dtype=dtype, generator=g)
        starts = torch.tensor([S], device=dev, dtype=torch.int32)
        N = max(1, int(args.budget_frac * S))
        index = torch.sort(torch.randperm(S, device=dev, generator=g)[:N]).values.expand(1, Hkv, N).to(torch.int32)
        kt = torch.randn(1, Hkv, args.k + 1, D, device=dev, dtype=dtype, generator=g)
        vt = torch.randn(1, Hkv, args.k + 1, D, device=dev, dtype=dtype, generator=g)
        kv_bytes = 2 * Hkv * (S + T) * D * esize
        cases = []
        for name, t, w in (("decode T=1", 1, 0), (f"verify T={T}", T, 0), (f"verify T={T} +rows W={W}", T, W)):
            q = torch.randn(1, H, t, D, device=dev, dtype=dtype, generator=g)
            extra = Hkv * (S + t) * D * esize + Hkv * w * (S + t) * 4 if w else 0  # K re-read + rows written
            for use in (True, False):
                cases.append((name, use, kv_bytes + extra,
                              lambda q=q, w=w, use=use: kernels.verify_attention(q, kc, vc, starts, w, scale, S, use=use)))
        q1 = torch.randn(1, H, 1, D, device=dev, dtype=dtype, generator=g)
        sparse_bytes = 2 * Hkv * N * D * esize + Hkv * N * 4
        for use in (True, False):
            cases.append((f"draft N={N}", use, sparse_bytes,
                          lambda use=use: kernels.sparse_attention(q1, kc, vc, index, None, kt[:, :, :1], vt[:, :, :1],
                                                                   scale, use=use)))
        for name, use, nbytes, fn in cases:
            try:
                sec = bench(fn)
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
                sec = float("nan")
            row = {"context": S, "case": name, "backend": "triton" if use else "torch", "seconds": sec,
                   "bytes": nbytes, "x_roofline": sec / (nbytes / bw)}
            graph = ""
            if args.graphs:
                try:
                    gsec = float(triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")) * 1e-3
                except Exception as e:  # not capturable (a host sync in the torch path), or out of memory
                    gsec, graph = float("nan"), f"  graph: {type(e).__name__}"
                    torch.cuda.empty_cache()
                row.update(seconds_graph=gsec, x_roofline_graph=gsec / (nbytes / bw))
                graph = graph or f"  graph {gsec * 1e6:8.1f} us {row['x_roofline_graph']:5.2f}x"
            results["rows"].append(row)
            print(f"S={S:6d}  {name:28s} {row['backend']:6s} {sec * 1e6:9.1f} us  {nbytes / sec / 1e9:7.0f} GB/s"
                  f"  {row['x_roofline']:5.2f}x roofline{graph}")
        del kc, vc
        torch.cuda.empty_cache()
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
