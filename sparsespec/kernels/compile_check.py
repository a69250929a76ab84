"""Compile the Triton kernels for an NVIDIA target without a GPU (ahead of time, to cubin).

The CPU interpreter runs kernels as Python, so it cannot catch what only the compiler sees (type
rules of runtime ``if``/``for``, layouts, register pressure). This compiles representative
launch variants with the same specialisations the JIT would apply (unit strides as constants,
16-byte divisibility of pointers and strides) through ptxas (bundled with triton), and reports
registers, spill stack and shared memory per variant.

    python -m sparsespec.kernels.compile_check [--arch 90] [--all]

Run it without ``TRITON_INTERPRET`` set (the kernels must be compiled, not interpreted).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time


def _variants(full: bool):
    """(kernel name, dtype, constexprs, num_warps, num_stages) of the launches worth compiling."""
    from sparsespec.kernels._triton import _fwd_config, _pow2

    out = []
    fwd = [(4, 1, 128, True, True, True, True), (4, 9, 128, False, False, False, True),
           (4, 17, 128, False, False, False, True), (3, 1, 64, True, False, False, False),
           (4, 4, 128, False, False, False, False)]
    if full:
        fwd += [(7, 17, 128, False, False, False, True), (4, 1, 128, False, False, False, False),
                (4, 1, 128, True, False, True, False)]
    dtypes = ["bf16", "fp16", "fp32"] if full else ["bf16", "fp32"]
    for dt in dtypes:
        for G, T, D, gather, tail, nvalid, split in fwd:
            bm = _pow2(G * T)
            bn, nw, ns = _fwd_config(bm, D, dt == "fp32")
            out.append(("_attn_fwd", dt, dict(H_KV=8, G=G, D=D, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=D, BLOCK_E=16,
                                              GATHER=gather, HAS_NVALID=nvalid, HAS_TAIL=tail, SPLIT=split,
                                              PREC="tf32x3" if dt == "fp32" else "tf32", UPCAST=False), nw, ns))
        out.append(("_combine", dt, dict(H=32, D=128, BLOCK_S=64, BLOCK_D=128), 4, 2))
        for G in (4, 7) if full else (4,):
            out.append(("_importance", dt, dict(H_KV=8, G=G, D=128, BLOCK_W=16, BLOCK_N=64, BLOCK_D=128,
                                                PREC="tf32x3" if dt == "fp32" else "tf32", UPCAST=False), 8, 2))
    return out


_PTR = {"_attn_fwd": {"Q": "x", "K": "x", "V": "x", "IDX": "i32", "NVALID": "i64", "STARTS": "i32", "KT": "x",
                      "VT": "x", "O": "x", "LSE": "fp32", "OP": "fp32", "LSEP": "fp32"},
        "_combine": {"OP": "fp32", "LSEP": "fp32", "O": "x", "LSE": "fp32"},
        "_importance": {"Q": "x", "K": "x", "LSE": "fp32", "STARTS": "i32", "ROWS": "fp32"}}
_UNIT_STRIDES = {"sqd", "skd", "svd", "sin_", "std_", "sud", "sod", "srs"}
_FLOATS = {"qk_scale"}


def _resource_usage(ck) -> str:
    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(ck.asm["cubin"])
    try:
        text = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    except OSError:
        return "?"
    finally:
        os.unlink(f.name)
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", text)
    return f"regs {m.group(1)} stack {m.group(2)}" if m else "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="SM version, e.g. 80 (A100), 90 (H100/H200)")
    ap.add_argument("--all", action="store_true", help="every dtype and more variants (minutes)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the kernels must be compiled", file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sparsespec.kernels import _triton as tk

    target = GPUTarget("cuda", args.arch, 32)
    failures = 0
    for name, dt, consts, num_warps, num_stages in _variants(args.all):
        kernel = getattr(tk, name)
        consts = dict(consts)
        for n in _UNIT_STRIDES & set(kernel.arg_names):
            consts[n] = 1
        sig, attrs = {}, {}
        for i, n in enumerate(kernel.arg_names):
            if n in consts:
                sig[n] = "constexpr"
            elif n in _PTR[name]:
                sig[n] = "*" + (dt if _PTR[name][n] == "x" else _PTR[name][n])
                attrs[(i,)] = [["tt.divisibility", 16]]
            elif n in _FLOATS:
                sig[n] = "fp32"
            else:
                sig[n] = "i32"
                if n.startswith("s") and n not in ("s_out", "split"):  # strides: multiples of 16 elements
                    attrs[(i,)] = [["tt.divisibility", 16]]
        label = f"{name} {dt} " + " ".join(f"{k}={v}" for k, v in consts.items()
                                          if k in ("G", "BLOCK_M", "GATHER", "HAS_TAIL", "HAS_NVALID", "SPLIT"))
        t0 = time.time()
        try:
            ck = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs), target=target,
                                options=dict(num_warps=num_warps, num_stages=num_stages))
        except Exception as e:  # report every failing variant, not just the first
            failures += 1
            print(f"FAIL {label}: {type(e).__name__}: {str(e)[:2000]}", flush=True)
            continue
        print(f"ok   {label} warps={num_warps} stages={num_stages}: {_resource_usage(ck)} smem {ck.metadata.shared} B "
              f"({time.time() - t0:.1f}s)", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
