"""One small case for ``compute-sanitizer --tool memcheck`` (run by tools/run_gpu_suite.sh):
``python memcheck_case.py [H] [Dk]``, H=8 by default (head tile 16, so pad heads); H=100 runs
the 64-head kernels (the warp-specialised forward, the two-warpgroup backward) on two head
groups with 28 pad heads.  Dk 576 (default, (Dk, Dv) = (576, 512)) or 512 (DeepSeek-V4's
(512, 512): the value is the whole kv row).  Top-k 100 (padded to 128 with -1), early rows
with few keys and whole -1 rows, with a sink; forward, deterministic (also with the exact dKV's re-run forced) and atomic
backward; then the three calls again with indices far out of range (each must raise the
``ValueError``, and, since the value checks are waited for after the kernels are queued, the
kernels must have read the checks' safe copy, never the bad values).  Any out-of-bounds access
in a kernel is reported by the sanitizer; the script itself checks for NaN and the errors."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

import torch  # noqa: E402

from paddlefleet.tilelang_ops.attn import exact_dkv, interface  # noqa: E402
from paddlefleet.tilelang_ops.attn.indices import causal_topk_indices  # noqa: E402

H = int(sys.argv[1]) if len(sys.argv) > 1 else 8
DK = int(sys.argv[2]) if len(sys.argv) > 2 else 576
if DK not in (576, 512):
    sys.exit(f"memcheck_case.py: Dk must be 576 or 512, got {DK}")
SCALE = DK ** -0.5
B, S, S_kv, L = 1, 16, 40, 100
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn((B, S, H, DK), generator=g, device="cuda").bfloat16()
kv = torch.randn((B, S_kv, DK), generator=g, device="cuda").bfloat16()
do = torch.randn((B, S, H, 512), generator=g, device="cuda").bfloat16()
sink = torch.randn((H,), generator=g, device="cuda")
idx = torch.from_numpy(causal_topk_indices(B, S, S_kv, L, seed=0)).cuda()
idx[:, :3] = -1
out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, SCALE, sink)
for det in (True, False):
    dq, dkv, ds = interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sink, idx, SCALE,
                                                  deterministic=det)
    assert not (dq.isnan().any() or dkv.isnan().any() or ds.isnan().any())
margin = exact_dkv.GRID_MARGIN_BITS
exact_dkv.GRID_MARGIN_BITS = -20  # every key re-runs: the with_dq=False kernel runs too
dq, dkv, ds = interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sink, idx, SCALE)
assert not (dq.isnan().any() or dkv.isnan().any() or ds.isnan().any())
exact_dkv.GRID_MARGIN_BITS = margin
bad = idx.clone()
bad[0, 5, 0], bad[0, 6, 1], bad[0, 7, 2], bad[0, 15, 3] = 10**7, -5, S_kv, -(2**31)
calls = [lambda: interface.mqa_latent_sparse_fwd(q, kv, bad, SCALE, sink)]
calls += [lambda det=det: interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sink, bad,
                                                          SCALE, deterministic=det)
          for det in (True, False)]
for call in calls:
    try:
        call()
    except ValueError as err:
        assert "token_indices" in str(err), err
    else:
        raise AssertionError("out-of-range indices did not raise")
torch.cuda.synchronize()
print(f"memcheck case H={H} Dk={DK} done")
