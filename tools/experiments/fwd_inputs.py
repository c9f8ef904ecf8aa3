"""GPU experiment: does the forward's time depend on which inputs the benchmark feeds it?

Run 45's benchmark timed the ``h128`` forward at 4.67 ms while the same-process trials of the
same kernel gave 4.18-4.21 ms (``ref``: equal within 0.02 ms).  The two differ in their inputs:
the benchmark rotates ``--sets`` (3) independent sets drawn on the device
(``bench_sparse_mqa.make_input_sets``, indices from ``torch.topk`` over random scores), the trial
reuses one set (``torch.randn`` with another seed, indices from ``attn.indices`` in numpy).  This
times the shipped forward, value checks on, on each combination, interleaved (A B C ... A B C)
so that clock drift shows as a spread, not as a difference:

    source tools/gpu_env.sh
    python3 tools/experiments/fwd_inputs.py --shapes h128,ref --reps 20 --rounds 3

Printed per shape: one line per feed with the median of each round.  Not a test, not the
benchmark: its lines go into docs/performance.md.
"""
import argparse
import sys

import torch

sys.path.insert(0, "src")
sys.path.insert(0, "tools/bench")
import bench_sparse_mqa as bench  # noqa: E402
import harness  # noqa: E402
import model  # noqa: E402
from paddlefleet.tilelang_ops.attn import interface  # noqa: E402
from paddlefleet.tilelang_ops.attn.indices import causal_topk_indices  # noqa: E402


def trial_set(s, device):
    """kernel_trial's inputs: one generator (seed 7), numpy causal indices (seed 0)."""
    g = torch.Generator(device=device).manual_seed(7)
    q = torch.randn((s.B, s.S, s.H, s.Dk), generator=g, device=device).bfloat16()
    kv = torch.randn((s.B, s.S_kv, s.Dk), generator=g, device=device).bfloat16()
    idx = torch.from_numpy(causal_topk_indices(s.B, s.S, s.S_kv, s.topk, seed=0)).to(device)
    sink = torch.randn((s.H,), generator=g, device=device)
    return {"q": q, "kv": kv, "idx": idx, "sink": sink, "sm_scale": s.Dk ** -0.5}


def feeds(s, device):
    sets = bench.make_input_sets(torch, s, device, sets=3)
    tri = trial_set(s, device)
    mixed = [dict(x, idx=tri["idx"]) for x in sets]  # the benchmark's tensors, numpy indices
    sorted_idx = [dict(x, idx=torch.sort(x["idx"], dim=-1).values) for x in sets]  # ascending
    return {"bench 3 sets": sets, "bench set 0 only": sets[:1], "trial set": [tri],
            "bench sets + numpy idx": mixed, "bench sets, idx sorted": sorted_idx}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="h128,ref")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    clock = harness.Clock(torch)

    def fwd(i):
        return interface.mqa_latent_sparse_fwd(i["q"], i["kv"], i["idx"], i["sm_scale"],
                                               i["sink"])

    for name in a.shapes.split(","):
        s = model.SHAPES[name]
        fs = feeds(s, "cuda")
        med = {k: [] for k in fs}
        for _ in range(a.rounds):
            for k, inputs in fs.items():
                med[k].append(harness.summarize(
                    harness.time_calls(clock, fwd, inputs, 3, a.reps))["ms"])
        for k, v in med.items():
            print(f"[{name}] fwd, {k}: " + " ".join(f"{x:.3f}" for x in v) + " ms", flush=True)
        del fs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
