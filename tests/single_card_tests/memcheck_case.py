"""One small case for ``compute-sanitizer --tool memcheck`` (run by tools/run_gpu_suite.sh):
``python memcheck_case.py [H]``, H=8 by default (head tile 16, so pad heads); H=100 runs the
64-head kernels (the warp-specialised forward, the two-warpgroup backward) on two head groups
with 28 pad heads.  Top-k 100 (padded to 128 with -1), early rows with few keys and whole -1
rows, with a sink; forward, deterministic (also with the exact dKV's re-run forced) and atomic
backward.  Any out-of-bounds access in a kernel is reported by the sanitizer; the script itself
only checks for NaN."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

import torch  # noqa: E402

from paddlefleet.tilelang_ops.attn import interface  # noqa: E402
from paddlefleet.tilelang_ops.attn.indices import causal_topk_indices  # noqa: E402

H = int(sys.argv[1]) if len(sys.argv) > 1 else 8
B, S, S_kv, L = 1, 16, 40, 100
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn((B, S, H, 576), generator=g, device="cuda").bfloat16()
kv = torch.randn((B, S_kv, 576), generator=g, device="cuda").bfloat16()
do = torch.randn((B, S, H, 512), generator=g, device="cuda").bfloat16()
sink = torch.randn((H,), generator=g, device="cuda")
idx = torch.from_numpy(causal_topk_indices(B, S, S_kv, L, seed=0)).cuda()
idx[:, :3] = -1
out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, 576 ** -0.5, sink)
for det in (True, False):
    dq, dkv, ds = interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sink, idx, 576 ** -0.5,
                                                  deterministic=det)
    assert not (dq.isnan().any() or dkv.isnan().any() or ds.isnan().any())
interface.GRID_MARGIN_BITS = -20  # every key re-runs: the with_dq=False kernel runs too
dq, dkv, ds = interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sink, idx, 576 ** -0.5)
assert not (dq.isnan().any() or dkv.isnan().any() or ds.isnan().any())
torch.cuda.synchronize()
print(f"memcheck case H={H} done")
