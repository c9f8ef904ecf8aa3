"""attn/lse.py: the bridge between the natural sink-exclusive LSE and the base-2 sink-inclusive
one, both ways, against numpy; -inf / +inf / NaN rows and sinks; errors.  (How the base-2 form
rebuilds the reference forward's probabilities is in tests/test_reference.py.)"""

from __future__ import annotations

import math

import numpy as np
import pytest

from helpers import rel_l2
from paddlefleet.tilelang_ops.attn.lse import lse_log2_sink_to_natural, lse_natural_to_log2_sink


def _lse_case(rng, H=8):
    lse = rng.standard_normal((2, 5, H)) * 3
    lse[0, 1] = -np.inf  # rows without keys
    sink = rng.standard_normal(H)
    return lse, sink


def test_lse_natural_to_log2_sink(fw, rng):
    lse, sink = _lse_case(rng)
    got = lse_natural_to_log2_sink(fw.t(lse), fw.t(sink))
    want = np.logaddexp(lse, sink) / math.log(2.0)
    assert rel_l2(fw.np(got), want) < 1e-15
    np.testing.assert_allclose(fw.np(got)[0, 1], sink / math.log(2.0), rtol=1e-15)
    # FlashMLA marks rows without keys with +inf instead: it must stay +inf, never NaN.
    plus = lse.copy()
    plus[0, 1] = np.inf
    np.testing.assert_array_equal(
        fw.np(lse_natural_to_log2_sink(fw.t(plus), fw.t(sink)))[0, 1], np.inf
    )
    # Without a sink it is a change of base only; -inf stays -inf.
    got = lse_natural_to_log2_sink(fw.t(lse))
    assert rel_l2(fw.np(got), lse / math.log(2.0)) < 1e-15


def test_lse_log2_sink_to_natural_inverts(fw, rng):
    lse, sink = _lse_case(rng)
    for s in (sink, None):
        lse2 = lse_natural_to_log2_sink(fw.t(lse), None if s is None else fw.t(s))
        back = lse_log2_sink_to_natural(lse2, None if s is None else fw.t(s))
        assert rel_l2(fw.np(back), lse) < 1e-12
        np.testing.assert_array_equal(fw.np(back)[0, 1], -np.inf)
    # fp32 in, fp32 out, within fp32 rounding where the keys weigh about as much as the sink
    # (lse within +-2 of it).  Far below the sink the inverse amplifies the rounding of lse2 by
    # 1 / (1 - exp(sink - total)): with lse drawn as above, some seeds of
    # $PFTO_TEST_SEED gave up to 6e-4.
    near = np.where(np.isfinite(lse), sink + rng.uniform(-2.0, 2.0, lse.shape), lse)
    lse32, sink32 = near.astype(np.float32), sink.astype(np.float32)
    back = lse_log2_sink_to_natural(
        lse_natural_to_log2_sink(fw.t(lse32), fw.t(sink32)), fw.t(sink32)
    )
    assert fw.np(back).dtype == np.float32
    assert rel_l2(fw.np(back), lse32) < 1e-5


def test_lse_bridge_minus_inf_sink(fw, rng):
    """Pad heads carry sink = -inf: the bridge reduces to a change of base, -inf rows stay -inf."""
    lse, sink = _lse_case(rng, H=4)
    sink[1] = -np.inf
    lse2 = lse_natural_to_log2_sink(fw.t(lse), fw.t(sink))
    np.testing.assert_allclose(fw.np(lse2)[..., 1], lse[..., 1] / math.log(2.0), rtol=1e-15)
    back = fw.np(lse_log2_sink_to_natural(lse2, fw.t(sink)))
    assert not np.isnan(back).any()
    assert rel_l2(back, lse) < 1e-12


def test_lse_bridge_bad_input(fw, rng):
    lse, sink = _lse_case(rng)
    with pytest.raises(TypeError, match="lse"):
        lse_natural_to_log2_sink(lse, fw.t(sink))
    with pytest.raises(TypeError, match="lse2: expected dtype float32 or float64"):
        lse_log2_sink_to_natural(fw.t(np.zeros(lse.shape, np.int64)), fw.t(sink))
    with pytest.raises(ValueError, match="attn_sink: expected shape"):
        lse_natural_to_log2_sink(fw.t(lse), fw.t(sink[:-1]))
    with pytest.raises(TypeError, match="attn_sink: expected dtype"):
        lse_natural_to_log2_sink(fw.t(lse), fw.t(sink.astype(np.int32)))


def test_lse_bridge_names_a_non_tensor_sink(fw, rng):
    lse, sink = _lse_case(rng)
    with pytest.raises(TypeError, match="^attn_sink: expected a paddle.Tensor or torch.Tensor, got numpy.ndarray"):
        lse_natural_to_log2_sink(fw.t(lse), sink)
    with pytest.raises(TypeError, match="^attn_sink: expected a paddle.Tensor or torch.Tensor, got list"):
        lse_log2_sink_to_natural(fw.t(lse), list(sink))


def test_lse_bridge_keeps_nan_sink_nan(fw, rng):
    """A NaN sink must not pass for a -inf one ("no sink"): the inverse bridge used to return
    the plain change of base there, a plausible finite lse."""
    lse, sink = _lse_case(rng)
    sink[2] = np.nan
    back = fw.np(lse_log2_sink_to_natural(fw.t(lse / math.log(2.0)), fw.t(sink)))
    assert np.isnan(back[..., 2]).all()
    others = np.delete(back, 2, axis=-1)
    assert not np.isnan(others).any()

