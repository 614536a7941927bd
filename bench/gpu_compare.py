#!/usr/bin/env python3
"""GPU side-by-side: mha's fused CUDA forward against PyTorch's SDPA backends (flash, cudnn,
efficient) on the same GPU, in the same run, on the same shapes.

  python bench/gpu_compare.py                       # the issue's table: B*L = 16384 tokens, 2048 channels
  python bench/gpu_compare.py --lengths 512 2048 8192 16384 --dims 64 128 --json out.json
  python bench/gpu_compare.py --backward            # the backward alone, beside each backend's

mha is timed by its command line (`build/tools/mha bench --device cuda --json`, which waits for
the kernel after each call), once per kernel in --kernels (MHA_CUDA_KERNEL: `auto` picks the
wgmma kernel on Hopper where it applies, `mma` forces the mma.sync one); PyTorch with CUDA events
around each call. FLOPs: 4 * B * H * L * L * d
forward (half when causal), 2.5x that for the backward (PyTorch's fwd+bwd column).
Each figure is the median of --reps timed calls after warm-up calls.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HERE = os.path.dirname(os.path.abspath(__file__))
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def flops(B, H, L, d, causal):
    return 4.0 * B * H * L * L * d * (0.5 if causal else 1.0)


def time_cuda(fn, reps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return statistics.median(times)


def torch_backend(name, B, H, L, d, causal, dtype, reps):
    q, k, v = (torch.randn(B, H, L, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(B, H, L, d, device="cuda", dtype=dtype)
    try:
        with sdpa_kernel(BACKENDS[name]):
            fwd = time_cuda(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), reps)
            both = time_cuda(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(grad), reps)
    except RuntimeError as e:  # a backend that does not take this shape
        return {"error": str(e).splitlines()[0]}
    return {"fwd_s": fwd, "fwd_bwd_s": both}


def ours(binary, kernel, B, H, L, d, causal, dtype, reps, backward=False, tile=None):
    cmd = [binary, "bench", "--device", "cuda", "--dtype", dtype, "-b", str(B), "--heads", str(H), "--lq", str(L),
           "--dim", str(d), "--reps", str(reps), "--warmup", "3", "--json"] + (["--causal"] if causal else [])
    env = dict(os.environ, MHA_CUDA_KERNEL=kernel)
    if tile:
        env["MHA_CUDA_BACKWARD_TILE"] = tile
    r = subprocess.run(cmd + (["--backward"] if backward else []), capture_output=True, text=True, env=env)
    if r.returncode != 0:
        return {"error": (r.stderr or r.stdout).strip().splitlines()[-1]}
    return {("bwd_s" if backward else "fwd_s"): json.loads(r.stdout)["ms_median"] / 1e3}


def backward_table(args, dtype):
    """Backward alone: mha's (its command line's --backward: one backward from a saved forward,
    gradients allocated per call), a column per --tiles entry (MHA_CUDA_BACKWARD_TILE), against
    each PyTorch backend's fwd+bwd less its fwd."""
    ours_names = [f"mha tile {t}" for t in args.tiles] if len(args.tiles) > 1 else ["mha"]
    names = [*ours_names, *BACKENDS]
    print("| d | L | causal | " + " | ".join(f"{n} bwd" for n in names) + " | " +
          " | ".join(f"{n} / flash | {n} / best" for n in ours_names) + " |")
    print("|" + " --- |" * (3 + len(names) + 2 * len(ours_names)))
    rows = []
    for d in args.dims:
        for L in args.lengths:
            for causal in (False, True):
                B, H = max(1, args.tokens // L), args.channels // d
                fl = 2.5 * flops(B, H, L, d, causal)
                row = {"B": B, "H": H, "L": L, "d": d, "causal": causal}
                for tile, name in zip(args.tiles, ours_names):
                    row[name] = ours(args.binary, "auto", B, H, L, d, causal, args.dtype, args.reps, backward=True,
                                     tile=tile)
                for name in BACKENDS:
                    r = torch_backend(name, B, H, L, d, causal, dtype, args.reps)
                    if "fwd_s" in r:
                        r["bwd_s"] = r["fwd_bwd_s"] - r["fwd_s"]
                    row[name] = r
                rows.append(row)
                rate = {n: fl / row[n]["bwd_s"] for n in names if "bwd_s" in row[n]}
                cells = [f"{rate[n] / 1e12:.0f}" if n in rate else "-" for n in names]
                peers = [rate[n] for n in BACKENDS if n in rate]
                for n in ours_names:
                    cells.append(f"{rate[n] / rate['flash']:.2f}x" if n in rate and "flash" in rate else "-")
                    cells.append(f"{rate[n] / max(peers):.2f}x" if n in rate and peers else "-")
                print(f"| {d} | {L} | {int(causal)} | " + " | ".join(cells) + " |", flush=True)
                for n in ours_names:
                    if "error" in row[n]:
                        print(f"{n}:", row[n]["error"])
    print("TFLOP/s at the median; the backward counts 2.5x the forward's FLOPs.")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192, 16384])
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--tokens", type=int, default=16384, help="B * L (B = tokens / L)")
    ap.add_argument("--channels", type=int, default=2048, help="H * d (H = channels / d)")
    ap.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--kernels", nargs="+", default=["auto"], choices=["auto", "mma", "wgmma"],
                    help="mha's kernels to time (a column each)")
    ap.add_argument("--binary", default=os.path.join(HERE, "..", "build", "tools", "mha"))
    ap.add_argument("--backward", action="store_true", help="time the backward alone instead of the forward")
    ap.add_argument("--tiles", nargs="+", default=[""], choices=["", "64", "32"],
                    help="with --backward: mha's tilings to time (MHA_CUDA_BACKWARD_TILE; '' the default)")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: this comparison runs on a GPU machine")
    dtype = getattr(torch, args.dtype)
    print(f"# {torch.cuda.get_device_name()}, PyTorch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"{args.dtype}, B*L = {args.tokens}, H*d = {args.channels}")
    if args.backward:
        rows = backward_table(args, dtype)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return
    ours_names = [f"mha {k}" if len(args.kernels) > 1 else "mha" for k in args.kernels]
    print("| d | L | causal | " + " | ".join(f"{n} fwd" for n in ours_names) +
          " | flash fwd / fwd+bwd | cudnn fwd / fwd+bwd | efficient fwd / fwd+bwd | " +
          " | ".join(f"{n} / flash | {n} / best" for n in ours_names) + " |")
    print("|" + " --- |" * (6 + 3 * len(ours_names)))
    rows = []
    for d in args.dims:
        for L in args.lengths:
            for causal in (False, True):
                B, H = max(1, args.tokens // L), args.channels // d
                fl = flops(B, H, L, d, causal)
                row = {"B": B, "H": H, "L": L, "d": d, "causal": causal}
                for kernel, name in zip(args.kernels, ours_names):
                    row[name] = ours(args.binary, kernel, B, H, L, d, causal, args.dtype, args.reps)
                for name in BACKENDS:
                    row[name] = torch_backend(name, B, H, L, d, causal, dtype, args.reps)
                rows.append(row)

                def tf(r, key, mult=1.0):
                    return f"{mult * fl / r[key] / 1e12:.0f}" if key in r else "-"

                def ratio(name, peers):
                    rates = [fl / row[n]["fwd_s"] for n in peers if "fwd_s" in row[n]]
                    return f"{fl / row[name]['fwd_s'] / max(rates):.2f}x" if rates and "fwd_s" in row[name] else "-"

                cells = ([tf(row[n], "fwd_s") for n in ours_names] +
                         [f"{tf(row[n], 'fwd_s')} / {tf(row[n], 'fwd_bwd_s', 3.5)}" for n in BACKENDS] +
                         [f"{ratio(n, ['flash'])} | {ratio(n, BACKENDS)}" for n in ours_names])
                print(f"| {d} | {L} | {int(causal)} | " + " | ".join(cells) + " |", flush=True)
    print("TFLOP/s at the median; fwd+bwd counts 3.5x the forward's FLOPs.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
