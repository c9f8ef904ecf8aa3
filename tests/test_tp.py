"""attn/tp.py on one process: the two tensor-parallel collectives and their PyLayers (the
multi-rank runs are tests/multi_card_tests)."""

from __future__ import annotations

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")  # the GPU host's torch-only env skips this module

from paddlefleet.tilelang_ops.attn.tp import (  # noqa: E402
    copy_to_tensor_parallel,
    default_tensor_parallel_group,
    reduce_from_tensor_parallel,
)


def test_collectives_on_one_rank_and_their_pylayers(rng, monkeypatch):
    """On one rank the wrappers return ``x`` itself.  The PyLayers behind them are run directly
    with ``all_reduce`` replaced by a stand-in for three identical ranks (sum = 3 x), so each
    direction shows: CopyToTensorParallel is the identity forward and sums the gradient,
    ReduceFromTensorParallel sums forward and passes the gradient through."""
    from paddlefleet.tilelang_ops.attn import tp

    assert default_tensor_parallel_group() is None and tp.group_world_size() == 1
    x = paddle.to_tensor(rng.standard_normal((3, 4)).astype(np.float32), stop_gradient=False)
    assert copy_to_tensor_parallel(x) is x and reduce_from_tensor_parallel(x) is x
    assert tp.all_to_all(x, 0, 1) is x and tp.gather_from_tensor_parallel(x) is x

    calls = []

    def fake_all_reduce(t, op=None, group=None):
        calls.append(group)
        t.scale_(3.0)  # in place, as dist.all_reduce works

    monkeypatch.setattr(tp.dist, "all_reduce", fake_all_reduce)
    x_np = x.numpy().copy()
    w = rng.standard_normal((3, 4)).astype(np.float32)
    group = object()
    y = tp.ReduceFromTensorParallel.apply(tp.CopyToTensorParallel.apply(x, group) * 2.0, group)
    np.testing.assert_allclose(y.numpy(), 3.0 * 2.0 * x_np, rtol=1e-6)
    np.testing.assert_array_equal(x.numpy(), x_np)  # out of place: the input is untouched
    assert calls == [group]  # forward: only the reduce
    (y * paddle.to_tensor(w)).sum().backward()
    assert calls == [group, group]  # backward: only the copy
    np.testing.assert_allclose(x.grad.numpy(), 3.0 * 2.0 * w, rtol=1e-6)
