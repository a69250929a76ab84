"""Launch configurations of the verify-attention kernel on this GPU, each in its own process.

For every (dtype, T, config) the child process runs ``kernels.verify_attention`` (Llama-3.1-8B
heads: H=32, H_kv=8, D=128; a ragged batch of 2 rows at 16000 / 12345 keys) with the config forced,
checks it against the float32 reference, and times it (``triton.testing.do_bench``, median). A
config that faults the device (illegal address, launch failure) only ends its own process, so the
rest still run; the parent prints one line per config and a JSON list with ``--json-out``.

    python benchmarks/kernel_configs.py --dtypes float32,bfloat16 --T 9,17 --json-out configs.json

A config is ``BLOCK_N:num_warps:num_stages[:precision]`` (precision ``tf32x3`` / ``ieee`` / ``tf32``;
default the kernel's own choice for the dtype). Exit status 0 when every dtype x T has at least
one config that ran and matched the reference.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

DEFAULT_CONFIGS = "16:8:1,16:4:1,32:4:1,32:8:1,64:4:1,64:8:2,16:4:1:ieee"


def _child(dtype_name: str, T: int, config: str) -> dict:
    import torch
    import triton.testing

    from sparsespec import kernels
    from sparsespec.kernels import _triton, verify_attention_ref

    parts = config.split(":")
    block_n, warps, stages = (int(x) for x in parts[:3])
    prec = parts[3] if len(parts) > 3 else None
    _triton._fwd_config = lambda *a, **k: (block_n, warps, stages)
    if prec:
        meta = _triton._meta
        _triton._meta = lambda q, num_warps: {**meta(q, num_warps), "PREC": prec}
    dtype = getattr(torch, dtype_name)
    dev = "cuda"
    B, H, Hkv, D, W = 2, 32, 8, 128, min(T, 16)
    g = torch.Generator(device=dev).manual_seed(T)
    q = torch.randn(B, H, T, D, device=dev, generator=g, dtype=dtype)
    kc = torch.randn(B, Hkv, 16400, D, device=dev, generator=g, dtype=dtype)
    vc = torch.randn(B, Hkv, 16400, D, device=dev, generator=g, dtype=dtype)
    starts = torch.tensor([16000, 12345], device=dev)
    out, rows = kernels.verify_attention(q, kc, vc, starts, W, D**-0.5, 16000, use=True)
    torch.cuda.synchronize()
    exact_out, exact_rows = verify_attention_ref(q.float(), kc.float(), vc.float(), starts, W, D**-0.5, 16000)
    err = (out.float() - exact_out).abs().max().item()
    rows_err = (rows - exact_rows).abs().max().item()
    sec = triton.testing.do_bench(lambda: kernels.verify_attention(q, kc, vc, starts, W, D**-0.5, 16000, use=True),
                                  warmup=10, rep=50, return_mode="median") * 1e-3
    return {"err": err, "rows_err": rows_err, "seconds": sec}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--T", default="9,17", help="query rows per sequence (k + 1)")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per child process")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--child", nargs=3, metavar=("DTYPE", "T", "CONFIG"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(_child(args.child[0], int(args.child[1]), args.child[2])), flush=True)
        return 0
    rows, ok_cells = [], set()
    env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1"}
    for dtype in args.dtypes.split(","):
        tol = (1e-4, 1e-5) if dtype == "float32" else (2e-2, 2e-3)
        for T in (int(x) for x in args.T.split(",")):
            for config in args.configs.split(","):
                row = {"dtype": dtype, "T": T, "config": config}
                try:
                    proc = subprocess.run([sys.executable, __file__, "--child", dtype, str(T), config], env=env,
                                          capture_output=True, text=True, timeout=args.timeout)
                    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                    if proc.returncode == 0 and lines:
                        row.update(json.loads(lines[-1][7:]))
                        row["status"] = "ok" if row["err"] <= tol[0] and row["rows_err"] <= tol[1] else "WRONG"
                    else:
                        last = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1:] or ["(no output)"]
                        row.update(status="FAILED", error=last[0][-200:])
                except subprocess.TimeoutExpired:
                    row.update(status="TIMEOUT")
                if row["status"] == "ok":
                    ok_cells.add((dtype, T))
                rows.append(row)
                extra = (f"err {row['err']:.2e} rows_err {row['rows_err']:.2e} {row['seconds'] * 1e6:8.1f} us"
                         if "seconds" in row else row.get("error", ""))
                print(f"{dtype:9s} T={T:3d} {config:16s} {row['status']:8s} {extra}", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)
    cells = {(d, int(t)) for d in args.dtypes.split(",") for t in args.T.split(",")}
    return 0 if cells <= ok_cells else 1


if __name__ == "__main__":
    raise SystemExit(main())
