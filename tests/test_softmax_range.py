"""Softmax numerics at extreme logits (issue 9): no finite floor, no ``exp(s - lse)``.

The input: Dk=576, Dv=512, H=2, S=4, S_kv=8, every row selects all 8 keys; ``q[..., 0]`` is
-32768 for head 0 and +32768 for head 1 (other channels 0), ``kv[..., 0] = -40960`` and
``kv[..., 1:Dv] = 1``, ``sm_scale = 576**-0.5``.  Every logit of a row is the same, about
``+5.6e7`` (head 0) or ``-5.6e7`` (head 1) after scaling (raw ``q.k`` = +-1.34e9), so the exact
``out`` is ``kv[..., :Dv]`` of any key: -40960 in channel 0, 1 elsewhere, and ``lse`` is
``log(8) + logit``.  A running max that starts at a finite floor gets head 1 wrong; computing
probabilities as ``exp(s - lse)`` loses ``|lse| * eps`` in the exponent (out = 8 instead of 1
here in fp32).  The GPU forward's version of this test is in
``tests/single_card_tests/test_sparse_attn_gpu.py``.
"""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest

from paddlefleet.tilelang_ops.attn.adapter import ops_for
from paddlefleet.tilelang_ops.attn.reference import sparse_mqa_fwd_ref

FRAMEWORKS = [fw for fw in ("paddle", "torch") if importlib.util.find_spec(fw) is not None]
DK, DV = 576, 512


def extreme_logits_case():
    """numpy ``(q, kv, idx, sm_scale, out_exact, lse_exact)`` of the input above."""
    B, S, S_kv, H = 1, 4, 8, 2
    q = np.zeros((B, S, H, DK), np.float32)
    q[:, :, 0, 0], q[:, :, 1, 0] = -32768.0, 32768.0
    kv = np.zeros((B, S_kv, DK), np.float32)
    kv[:, :, 0] = -40960.0
    kv[:, :, 1:DV] = 1.0
    idx = np.broadcast_to(np.arange(S_kv, dtype=np.int32), (B, S, S_kv)).copy()
    sm = DK ** -0.5
    out = np.broadcast_to(kv[:, :1, :DV][:, :, None], (B, S, H, DV)).astype(np.float64)
    logit = np.array([-32768.0, 32768.0]) * -40960.0 * sm
    lse = np.broadcast_to(math.log(S_kv) + logit, (B, S, H)).astype(np.float64)
    return q, kv, idx, sm, out, lse


def _tensor(fw, arr, dtype):
    if fw == "paddle":
        import paddle

        return paddle.to_tensor(np.ascontiguousarray(arr)).astype(dtype)
    import torch

    return torch.from_numpy(np.ascontiguousarray(arr)).to(getattr(torch, dtype))


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_reference_forward_at_extreme_logits(fw, dtype):
    q, kv, idx, sm, out_x, lse_x = extreme_logits_case()
    out, lse = sparse_mqa_fwd_ref(_tensor(fw, q, "bfloat16"), _tensor(fw, kv, "bfloat16"),
                                  _tensor(fw, idx, "int32"), sm, dtype=dtype)
    ops = ops_for(out)
    out, lse = np.asarray(ops.to_numpy(out)), np.asarray(ops.to_numpy(lse))
    # both heads: 1 in channels 1.., -40960 in channel 0 (was 8 = L for head 1 in fp32)
    np.testing.assert_allclose(out, out_x, rtol=1e-6, atol=0)
    assert np.isfinite(lse).all()
    np.testing.assert_allclose(lse, lse_x, rtol=1e-6)
