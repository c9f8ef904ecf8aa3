"""GPU microbenchmark: how fast do 16-byte fp32 atomics reach the L2, by piece size per row?

The atomic backward adds each key block's dKV with ``atomic_addx4`` (``RED.E.ADD.F32x4``)
straight from the wgmma accumulator: a warp instruction covers 8 key rows, 64 contiguous bytes
of each (4 lanes x 16 bytes).  Run 78's profile has the kernel waiting on those atomics with
the L2 at 63% of its peak, while the round-1 microbenchmark (``tools/bench/scatter_micro.py``,
512 contiguous bytes per warp instruction) added the same volume at 3.4-3.6 TB/s.  This times
the scatter alone with ``G`` key rows per warp instruction, each row's piece ``32 / G`` lanes x
16 bytes wide (``G = 8``: 64 bytes, the kernel's pattern; 4: 128 bytes; 2: 256 bytes), at the
``ref`` volume: ``rows = S * topk`` rows of ``Dk = 576`` fp32 into ``[S_kv, Dk]``, the rows of a
group distinct keys (slices of permutations, as one query row's slots are).

    source tools/gpu_env.sh
    python3 tools/experiments/red_pieces.py [--rows 8388608] [--s-kv 8192] [--reps 5]

Prints ms (the benchmark's timing: CUDA events per launch, median) and payload TB/s per ``G``
(``rows_per_warp=G piece=512/G B``), with the median SM clock while the launches ran.  The
values are made in registers from the row and column (no HBM read besides the indices).  Run
from the repository root (``src`` and ``tools/bench`` are put on ``sys.path`` relative to it);
needs a CUDA GPU.
"""
import argparse
import sys
import time

sys.path.insert(0, "src")
sys.path.insert(0, "tools/bench")
import harness  # noqa: E402
from paddlefleet.tilelang_ops import settings  # noqa: E402

tilelang = settings.import_tilelang()
from tilelang import language as T  # noqa: E402

DK = 576
PIECE_ROWS = (8, 4, 2)


@tilelang.jit(pass_configs=settings.PASS_CONFIGS)
def red_pieces(rows_per_warp: int, d_k: int = DK, threads: int = 256):
    """``Acc[Idx[r], :] += v(r, :)`` for every row ``r`` with ``Idx[r] >= 0``: each warp takes
    ``rows_per_warp`` rows at a time and walks their columns in pieces of ``32 / rows_per_warp``
    lanes x 4 fp32, one ``atomic_addx4`` per lane and piece."""
    G = rows_per_warp
    W = 32 // G  # lanes per row
    assert 32 % G == 0 and d_k % (4 * W) == 0, "a row's columns in whole pieces"
    rows_per_cta = threads // 32 * G
    R = T.dynamic("R")
    S_kv = T.dynamic("S_kv")

    @T.prim_func
    def main(Idx: T.Tensor([R], "int32"), Acc: T.Tensor([S_kv, d_k], "float32")):
        with T.Kernel(T.ceildiv(R, rows_per_cta), threads=threads) as bx:
            tx = T.get_thread_binding()
            v = T.alloc_local([4], "float32")
            key = T.alloc_local([1], "int32")
            r = bx * rows_per_cta + tx // 32 * G + tx % 32 // W
            key[0] = -1
            if r < R:
                key[0] = Idx[r]
            if key[0] >= 0:
                for p in T.serial(d_k // (4 * W)):
                    for e in T.unroll(4):
                        v[e] = T.Cast("float32", (r * 7 + p * 13 + e) % 17) * 0.25 - 2.0
                    T.atomic_addx4(Acc[key[0], p * 4 * W + tx % W * 4], v[0])

    return main


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--rows", type=int, default=4096 * 2048,
                    help="rows added (S * topk; ref: 4096 * 2048)")
    ap.add_argument("--s-kv", type=int, default=8192, help="key rows of the accumulator")
    ap.add_argument("--reps", type=int, default=5, help="timed launches per G (median)")
    args = ap.parse_args(argv)
    import torch
    from bench_sparse_mqa import sampled_calls

    gen = torch.Generator(device="cuda").manual_seed(0)
    n_perm = -(-args.rows // args.s_kv)
    idx = torch.argsort(torch.rand((n_perm, args.s_kv), generator=gen, device="cuda"), dim=1)
    idx = idx.to(torch.int32).reshape(-1)[:args.rows].contiguous()
    acc = torch.zeros((args.s_kv, DK), dtype=torch.float32, device="cuda")
    gb = args.rows * DK * 4 / 1e9
    print(f"rows={args.rows} s_kv={args.s_kv} payload {gb:.1f} GB", flush=True)
    for g in PIECE_ROWS:
        t = time.time()
        kernel = red_pieces(g)
        print(f"[build] rows_per_warp={g}: {time.time() - t:.1f}s", flush=True)
        times, gpu = sampled_calls(torch, harness.Clock(torch), lambda _: kernel(idx, acc),
                                   [None], 1, args.reps)
        ms = harness.summarize(times)["ms"]
        print(f"rows_per_warp={g} piece={512 // g} B: {ms:.3f} ms, {gb / ms:.2f} TB/s payload"
              f"{harness.clock_note(gpu['sm_mhz'])}", flush=True)


if __name__ == "__main__":
    main()
