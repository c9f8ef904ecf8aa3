"""Small-call check of a kernel variant against the shipped kernels, dKV compared by column block.

A wrong dKV in one warpgroup's columns shows as one bad block (the first ``split`` build of the
warp-specialised backward: columns 256-576 wrong, 0-256 right).  Small enough to run under
``compute-sanitizer`` (memcheck, racecheck, synccheck).

    source tools/gpu_env.sh
    python3 tools/experiments/dkv_blocks.py "row_lanes=4,pred_red=False" [S]

FIELDS as ``kernel_trial.py --bwd`` (schedule fields by name); ``S`` query rows
(default 64; B=1, S_kv=256, H=64, top-k 64, with a sink).
"""
import sys

import torch

sys.path.insert(0, "src")
sys.path.insert(0, "tools/bench")
sys.path.insert(0, "tools/experiments")
from kernel_trial import Variant, parse_fields  # noqa: E402
from paddlefleet.tilelang_ops.attn import interface  # noqa: E402
from paddlefleet.tilelang_ops.attn.indices import causal_topk_indices  # noqa: E402

COLUMN_BLOCKS = ((0, 64), (64, 256), (256, 512), (512, 576))


def main():
    changes = parse_fields(sys.argv[1])
    B, S, SKV, H, K = 1, int(sys.argv[2]) if len(sys.argv) > 2 else 64, 256, 64, 64
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn((B, S, H, 576), generator=g, device="cuda").bfloat16()
    kv = torch.randn((B, SKV, 576), generator=g, device="cuda").bfloat16()
    do = torch.randn((B, S, H, 512), generator=g, device="cuda").bfloat16()
    idx = torch.from_numpy(causal_topk_indices(B, S, SKV, K, seed=0)).cuda()
    sink = torch.randn((H,), generator=g, device="cuda")
    sm = 576 ** -0.5
    out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, sm, sink, check_indices=False)
    variant = Variant(bwd_fields=changes)
    for det in (False, True):
        args = (q, kv, out, do, lse, sink, idx, sm)
        a = interface.mqa_latent_sparse_bwd(*args, deterministic=det, check_indices=False)
        b = interface.mqa_latent_sparse_bwd(*args, deterministic=det, check_indices=False,
                                            provider=variant)
        da, db = a[1].float(), b[1].float()
        for lo, hi in COLUMN_BLOCKS:
            x, y = da[..., lo:hi], db[..., lo:hi]
            print(f"det={det} cols {lo}:{hi} rel {((x - y).norm() / x.norm()).item():.3e}"
                  f" ratio {(y.norm() / x.norm()).item():.3f}")
        print(f"det={det} dq equal {torch.equal(a[0], b[0])} dkv equal {torch.equal(a[1], b[1])}",
              flush=True)


if __name__ == "__main__":
    main()
