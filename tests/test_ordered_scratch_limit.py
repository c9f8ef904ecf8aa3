"""The ordered deterministic mode refuses a scratch its kernels cannot address (int32 offsets).

The kernels index the slot-partial scratch ``[rows, G, L, Dk]`` fp32 with int32 offsets, which
the default 8 GiB budget (2**31 fp32 elements) just fits; a larger budget or an extremely wide
top-k must raise a clear ValueError, never overflow silently.  Runs on CPU against the stand-in
provider of test_interface.py (the check fires before any kernel is launched).
"""

import importlib.util

import numpy as np
import pytest

from paddlefleet.tilelang_ops.attn import interface
from test_interface import CpuStandIn, _tensor

FRAMEWORKS = [fw for fw in ("paddle", "torch") if importlib.util.find_spec(fw) is not None]


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_scratch_past_int32_offsets_raises(fw, monkeypatch):
    rng = np.random.default_rng(0)
    S, S_kv, Dk, Dv = 64, 8, 576, 512
    L = 58304  # 64 rows x 58304 slots x 576 > 2**31 elements once the budget allows all rows
    q = _tensor(fw, rng.standard_normal((1, S, 1, Dk), dtype=np.float32), "bfloat16")
    kv = _tensor(fw, rng.standard_normal((1, S_kv, Dk), dtype=np.float32), "bfloat16")
    out = _tensor(fw, rng.standard_normal((1, S, 1, Dv), dtype=np.float32), "bfloat16")
    do = _tensor(fw, rng.standard_normal((1, S, 1, Dv), dtype=np.float32), "bfloat16")
    lse = _tensor(fw, rng.standard_normal((1, S, 1), dtype=np.float32), "float32")
    idx = np.full((1, S, L), -1, np.int32)
    idx[:, :, 0] = rng.integers(0, S_kv, S)
    idx = _tensor(fw, idx, "int32")
    monkeypatch.setattr(interface, "ORDERED_SCRATCH_BYTES", 1 << 40)
    prov = CpuStandIn()
    with pytest.raises(ValueError, match="int32 scratch offsets"):
        interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, None, idx, Dk ** -0.5, provider=prov)
    assert not any(c[0] == "main" for c in prov.calls)
