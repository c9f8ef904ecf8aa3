"""Microbenchmark: what does the backward's dKV scatter cost, per accumulation scheme?

The sparse backward adds one ``Dk``-wide fp32 row per (query row, top-k slot) into ``dKV`` at a
data-dependent key row.  This times that scatter alone on the GPU, with the contributions made
in registers (no HBM read of staged values, unlike the round-1 microbenchmark), at the
reference shape's volume: ``rows = S * topk`` rows of ``Dk`` into ``[S_kv, Dk]``.

Schemes (one CUDA kernel each, NVRTC through CuPy):
  f32x4      ``red.global.add.v4.f32``: the atomic path (order-dependent rounding)
  f32        scalar ``red.global.add.f32``
  u32        scalar 32-bit integer add (fixed point, 32 bits)
  u64        scalar 64-bit integer add (fixed point, 64 bits)
  f32x4_x2   two ``v4.f32`` adds per element (a hi/lo pair of exact fp32 accumulators)
  shard_rmw  plain load + add + store into one private fp32 shard per CTA (``grid`` shards,
             each CTA owns one: bounded-shard determinism), rows in HBM
  shard_red  ``red.v4.f32`` into the CTA's private shard

Usage (GPU host):  python3 tools/bench/scatter_micro.py [--rows 8388608] [--s-kv 8192]
Prints ms and effective payload TB/s per scheme.
"""

from __future__ import annotations

import argparse

SRC = r"""
extern "C" __device__ __forceinline__ unsigned hash32(unsigned x) {
    x ^= x >> 16; x *= 0x7feb352dU; x ^= x >> 15; x *= 0x846ca68bU; x ^= x >> 16; return x;
}
extern "C" __device__ __forceinline__ float val(unsigned r, unsigned c) {
    return (float)(int)(hash32(r * 1315423911u + c) & 0xffff) * 1e-4f - 3.2f;
}
// a CTA of 144 * R threads handles R rows (distinct keys, as the slots of one query row are)
// per step; thread t owns columns 4 (t % 144) .. + 3 of row t / 144
#define DK 576
extern "C" __global__ void scatter(const int* __restrict__ idx, long rows, int mode,
                                   float* acc, unsigned long long* acc64, unsigned* acc32,
                                   float* shards, long s_kv) {
    int t = threadIdx.x % 144;
    int R = blockDim.x / 144;
    for (long g = blockIdx.x; g * R < rows; g += gridDim.x) {
        long r = g * R + threadIdx.x / 144;
        if (r >= rows) continue;
        int j = idx[r];
        if (j < 0) continue;
        float v0 = val(r, 4 * t), v1 = val(r, 4 * t + 1), v2 = val(r, 4 * t + 2),
              v3 = val(r, 4 * t + 3);
        long off = (long)j * DK + 4 * t;
        if (mode == 0) {
            atomicAdd((float4*)(acc + off), make_float4(v0, v1, v2, v3));
        } else if (mode == 1) {
            atomicAdd(acc + off, v0); atomicAdd(acc + off + 1, v1);
            atomicAdd(acc + off + 2, v2); atomicAdd(acc + off + 3, v3);
        } else if (mode == 2) {
            atomicAdd(acc32 + off, (unsigned)(int)(v0 * 1024.f));
            atomicAdd(acc32 + off + 1, (unsigned)(int)(v1 * 1024.f));
            atomicAdd(acc32 + off + 2, (unsigned)(int)(v2 * 1024.f));
            atomicAdd(acc32 + off + 3, (unsigned)(int)(v3 * 1024.f));
        } else if (mode == 3) {
            atomicAdd(acc64 + off, (unsigned long long)(long long)(v0 * 1048576.f));
            atomicAdd(acc64 + off + 1, (unsigned long long)(long long)(v1 * 1048576.f));
            atomicAdd(acc64 + off + 2, (unsigned long long)(long long)(v2 * 1048576.f));
            atomicAdd(acc64 + off + 3, (unsigned long long)(long long)(v3 * 1048576.f));
        } else if (mode == 4) {
            atomicAdd((float4*)(acc + off), make_float4(v0, v1, v2, v3));
            atomicAdd((float4*)(acc + s_kv * DK + off),
                      make_float4(v0 * 1e-3f, v1 * 1e-3f, v2 * 1e-3f, v3 * 1e-3f));
        } else if (mode == 5) {
            float4* p = (float4*)(shards + (long)blockIdx.x * s_kv * DK + off);
            float4 a = *p;
            a.x += v0; a.y += v1; a.z += v2; a.w += v3;
            *p = a;
        } else {
            atomicAdd((float4*)(shards + (long)blockIdx.x * s_kv * DK + off),
                      make_float4(v0, v1, v2, v3));
        }
    }
}
"""

MODES = ["f32x4", "f32", "u32", "u64", "f32x4_x2", "shard_rmw", "shard_red"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=4096 * 2048)
    p.add_argument("--s-kv", type=int, default=8192)
    p.add_argument("--grid", type=int, default=132 * 8, help="CTAs (= shards for shard_*)")
    p.add_argument("--shard-grid", type=int, default=132)
    p.add_argument("--rows-per-cta", type=int, default=4)
    args = p.parse_args(argv)
    import cupy as cp

    kern = cp.RawKernel(SRC, "scatter", options=("-arch=sm_90",))
    rng = cp.random.default_rng(0)
    # consecutive rows hit distinct keys (pieces of permutations), like the slots of one query row
    n_perm = -(-args.rows // args.s_kv)
    idx = cp.argsort(rng.random((n_perm, args.s_kv), dtype=cp.float32), axis=1)
    idx = idx.astype(cp.int32).ravel()[: args.rows].copy()
    dk = 576
    acc = cp.zeros(2 * args.s_kv * dk, cp.float32)
    acc64 = cp.zeros(args.s_kv * dk, cp.uint64)
    acc32 = cp.zeros(args.s_kv * dk, cp.uint32)
    shards = cp.zeros(args.shard_grid * args.s_kv * dk, cp.float32)
    payload = {0: 4, 1: 4, 2: 4, 3: 8, 4: 8, 5: 4, 6: 4}
    print(f"rows={args.rows} s_kv={args.s_kv} payload at 4 B/elem = "
          f"{args.rows * dk * 4 / 1e9:.1f} GB")
    for mode, name in enumerate(MODES):
        grid = args.shard_grid if mode >= 5 else args.grid
        launch = lambda: kern((grid,), (144 * args.rows_per_cta,), (idx, cp.int64(args.rows), cp.int32(mode), acc,  # noqa: E731
                                                acc64, acc32, shards, cp.int64(args.s_kv)))
        launch()
        cp.cuda.Device().synchronize()
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        times = []
        for _ in range(5):
            start.record()
            launch()
            stop.record()
            stop.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, stop))
        ms = sorted(times)[2]
        tbs = args.rows * dk * payload[mode] / ms / 1e9
        print(f"{name:10s} {ms:8.3f} ms   {tbs:6.2f} TB/s payload")


if __name__ == "__main__":
    main()
