"""attn/checks.py: every rule, its error type, its message, and the order of the checks
(tensor checks, then value checks)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from paddlefleet.tilelang_ops.attn.checks import (
    Dims,
    check_compute_dtype,
    check_cu_seqlens,
    check_indices_in_documents,
    check_sm_scale,
    check_tensors,
    check_values,
)

B, S, H, DK, DV, S_KV, L = 2, 3, 4, 24, 16, 7, 5


def T(a):
    return paddle.to_tensor(np.ascontiguousarray(a))


def test_torch_tensors(rng):
    """The same checks on PyTorch tensors (the GPU host's framework)."""
    torch = pytest.importorskip("torch")
    q = torch.randn(B, S, H, DK, dtype=torch.bfloat16)
    kv = torch.randn(B, S_KV, DK, dtype=torch.bfloat16)
    idx = torch.from_numpy(rng.integers(-1, S_KV, (B, S, L)))
    sink = torch.randn(H)

    def both(q, kv, idx, **kw):
        dims = check_tensors(q, kv, idx, **kw)
        check_values(dims, idx, attn_sink=kw.get("attn_sink"), lse=kw.get("lse"))
        return dims

    dims = both(q, kv, idx, attn_sink=sink, d_v=DV, float_dtypes=("bfloat16",))
    assert dims == Dims(B=B, S=S, H=H, Dk=DK, Dv=DV, S_kv=S_KV, L=L)
    with pytest.raises(ValueError, match="^query: expected a tensor on cuda, got one on cpu"):
        check_tensors(q, kv, idx, d_v=DV, device="cuda")
    with pytest.raises(TypeError, match=r"^query: expected dtype in \['bfloat16'\], got float32"):
        check_tensors(q.float(), kv.float(), idx, d_v=DV, float_dtypes=("bfloat16",))
    with pytest.raises(TypeError, match="^attn_sink: expected dtype"):
        check_tensors(q, kv, idx, attn_sink=sink.double(), d_v=DV)
    idx[0, 0, 0] = S_KV
    with pytest.raises(ValueError, match="^token_indices: expected values"):
        both(q, kv, idx, d_v=DV)
    idx[0, 0, 0] = -1
    bad_sink = sink.clone()
    bad_sink[2] = float("nan")
    with pytest.raises(ValueError, match=r"^attn_sink: .*got \[nan\] at heads \[2\]"):
        both(q, kv, idx, attn_sink=bad_sink, d_v=DV)
    lse = torch.randn(B, S, H)
    lse[1, 0, 3] = float("nan")
    with pytest.raises(ValueError, match="^lse: expected no NaN.*got 1 NaN"):
        both(q, kv, idx, lse=lse, d_v=DV)
    lse[1, 0, 3] = float("inf")
    assert both(q, kv, idx, lse=lse, d_v=DV).H == H


# Everything below runs on Paddle (the CI framework) through the `good` fixture.
try:
    import paddle
except ImportError:
    paddle = None


@pytest.fixture
def good(rng):
    pytest.importorskip("paddle")
    idx = rng.integers(-1, S_KV, (B, S, L)).astype(np.int32)
    idx[0, 0, 0], idx[1, 2, 4] = -1, S_KV - 1  # both ends of the valid range
    return dict(
        query=T(rng.standard_normal((B, S, H, DK)).astype(np.float32)),
        kv=T(rng.standard_normal((B, S_KV, DK)).astype(np.float32)),
        token_indices=T(idx),
        attn_sink=T(rng.standard_normal(H).astype(np.float32)),
        out=T(rng.standard_normal((B, S, H, DV)).astype(np.float32)),
        grad_out=T(rng.standard_normal((B, S, H, DV)).astype(np.float32)),
        lse=T(rng.standard_normal((B, S, H)).astype(np.float32)),
    )


def call(args, values=True, **kw):
    """check_tensors on ``args`` (``d_v`` defaults to DV), then check_values unless
    ``values=False``."""
    a = dict(args)
    q, kv, idx = a.pop("query"), a.pop("kv"), a.pop("token_indices")
    a.update(kw)
    a.setdefault("d_v", DV)
    dims = check_tensors(q, kv, idx, **a)
    if values:
        check_values(dims, idx, attn_sink=a.get("attn_sink"), lse=a.get("lse"))
    return dims


def test_valid_call_returns_dims(good):
    dims = call(good)
    assert dims == Dims(B=B, S=S, H=H, Dk=DK, Dv=DV, S_kv=S_KV, L=L)
    with pytest.raises(AttributeError):
        dims.B = 3  # frozen
    # Optional tensors may be left out; int64 indices and bf16 floats are fine.
    minimal = {k: good[k] for k in ("query", "kv", "token_indices")}
    assert call(minimal) == dims
    minimal["token_indices"] = good["token_indices"].astype("int64")
    assert call(minimal) == dims
    bf16 = {k: good[k].astype("bfloat16") for k in ("query", "kv")}
    assert call({**minimal, **bf16}, float_dtypes=("bfloat16",)) == dims


@pytest.mark.parametrize("name", ["query", "kv", "token_indices", "attn_sink", "out", "lse"])
def test_not_a_tensor(good, name):
    bad = dict(good, **{name: good[name].numpy()})
    with pytest.raises(TypeError, match=f"^{name}: expected a paddle.Tensor or torch.Tensor, got numpy.ndarray"):
        call(bad)


def test_required_tensor_none(good):
    with pytest.raises(TypeError, match="^kv: expected a paddle.Tensor or torch.Tensor, got None"):
        call(dict(good, kv=None))


@pytest.mark.parametrize(
    "name,shape,expected",
    [
        ("query", (B, S, H * DK), "4 dims [B, S, H, Dk]"),
        ("kv", (B, S_KV, 1, DK), "3 dims [B, S_kv, Dk]"),
        ("token_indices", (B, S * L), "3 dims [B, S, L]"),
        ("attn_sink", (1, H), "1 dims [H]"),
        ("grad_out", (B, S, H * DV), "4 dims [B, S, H, Dv]"),
        ("lse", (B, S, H, 1), "3 dims [B, S, H]"),
    ],
)
def test_ndim(good, name, shape, expected):
    bad = dict(good, **{name: good[name].reshape(list(shape))})
    pattern = re.escape(f"{name}: expected {expected}, got {len(shape)} dims")
    with pytest.raises(ValueError, match="^" + pattern):
        call(bad)


def test_device(good):
    with pytest.raises(ValueError, match="^query: expected a tensor on cuda, got one on cpu"):
        call(good, device="cuda")
    assert call(good, device="cpu").B == B


@pytest.mark.parametrize(
    "name,dtype,pattern",
    [
        ("query", "float16", r"^query: expected dtype in \['bfloat16'\], got float16"),
        ("out", "float32", r"^out: expected dtype in \['bfloat16'\], got float32"),
    ],
)
def test_float_dtypes(good, name, dtype, pattern):
    args = {k: (v.astype("bfloat16") if k in ("query", "kv", "out", "grad_out") else v)
            for k, v in good.items()}
    args[name] = good[name].astype(dtype)
    with pytest.raises(TypeError, match=pattern):
        call(args, float_dtypes=("bfloat16",))


def test_other_dtypes(good):
    with pytest.raises(TypeError, match=r"^kv: expected the dtype of query \(float32\), got float64"):
        call(dict(good, kv=good["kv"].astype("float64")))
    with pytest.raises(TypeError, match="^token_indices: expected dtype int32 or int64, got float32"):
        call(dict(good, token_indices=good["token_indices"].astype("float32")))
    with pytest.raises(TypeError, match="^token_indices: expected dtype int32 or int64, got int16"):
        call(dict(good, token_indices=good["token_indices"].astype("int16")))
    for name in ("attn_sink", "lse"):
        with pytest.raises(TypeError, match=rf"^{name}: expected dtype in \['float32'\], got float64"):
            call(dict(good, **{name: good[name].astype("float64")}))
    # The fp64 reference widens the sink/lse dtypes explicitly.
    assert call(dict(good, attn_sink=good["attn_sink"].astype("float64")),
                aux_float_dtypes=("float32", "float64")).H == H
    with pytest.raises(TypeError, match=r"^query: expected dtype in"):
        call(dict(good, query=good["query"].astype("int32"), kv=good["kv"].astype("int32")))


@pytest.mark.parametrize(
    "name,shape,pattern",
    [
        ("kv", (B + 1, S_KV, DK), r"^kv: expected \[B, S_kv, Dk\] with B=2 and Dk=24 \(from query\), got shape \[3, 7, 24\]"),
        ("kv", (B, S_KV, DK + 1), r"^kv: expected \[B, S_kv, Dk\] with B=2 and Dk=24"),
        ("token_indices", (B, S + 1, L), r"^token_indices: expected \[B, S, L\] with B=2 and S=3 \(from query\), got shape \[2, 4, 5\]"),
        ("token_indices", (B, S, 0), r"^token_indices: expected L >= 1"),
        ("attn_sink", (H + 1,), r"^attn_sink: expected shape \[H\] with H=4 \(from query\), got \[5\]"),
        ("lse", (B, S, H + 1), r"^lse: expected shape \[B, S, H\] = \[2, 3, 4\], got \[2, 3, 5\]"),
        ("out", (B, S, H, DV + 1), r"^out: expected shape \[B, S, H, Dv\] = \[2, 3, 4, 16\], got \[2, 3, 4, 17\]"),
        ("grad_out", (B, S + 1, H, DV), r"^grad_out: expected shape \[B, S, H, Dv\]"),
        ("query", (B, S, 0, DK), r"^query: expected B, S, H, Dk >= 1"),
        ("kv", (B, 0, DK), r"^kv: expected S_kv >= 1"),
    ],
)
def test_shapes(good, rng, name, shape, pattern):
    dtype = str(good[name].dtype).rsplit(".", 1)[-1]
    bad = dict(good, **{name: T(np.zeros(shape, dtype=dtype))})
    with pytest.raises(ValueError, match=pattern):
        call(bad, values=False)


def test_d_v(good):
    with pytest.raises(TypeError, match="^d_v: expected a Python int, got float"):
        call(good, d_v=16.0)
    with pytest.raises(TypeError, match="^d_v: expected a Python int, got bool"):
        call(good, d_v=True)
    with pytest.raises(ValueError, match=r"^d_v: expected 1 <= d_v <= Dk=24, got 25"):
        call({k: good[k] for k in ("query", "kv", "token_indices")}, d_v=DK + 1)
    with pytest.raises(ValueError, match=r"^d_v: expected 1 <= d_v <= Dk=24, got 0"):
        call({k: good[k] for k in ("query", "kv", "token_indices")}, d_v=0)


def test_dv_from_out_else_grad_out(good):
    """A backward call passes no d_v: Dv is out's last dim (what the forward produced), else
    grad_out's; a grad_out that disagrees with out is the one named."""
    assert call(good, d_v=None).Dv == DV
    assert call(dict(good, out=None), d_v=None).Dv == DV
    short = T(np.zeros((B, S, H, DV - 1), np.float32))
    assert call(dict(good, out=None, grad_out=short), d_v=None).Dv == DV - 1
    with pytest.raises(ValueError) as err:
        call(dict(good, grad_out=short), d_v=None)
    assert str(err.value) == ("grad_out: expected shape [B, S, H, Dv] = [2, 3, 4, 16] (Dv from "
                              "out), got [2, 3, 4, 15]")
    with pytest.raises(ValueError) as err:
        call(dict(good, out=short), d_v=None)
    assert str(err.value) == ("grad_out: expected shape [B, S, H, Dv] = [2, 3, 4, 15] (Dv from "
                              "out), got [2, 3, 4, 16]")
    with pytest.raises(ValueError, match=r"^out: expected \[B, S, H, Dv\] with B=2, S=3 and H=4 "
                                         r"\(from query\), got shape \[2, 3, 5, 16\]"):
        call(dict(good, out=T(np.zeros((B, S, H + 1, DV), np.float32))), d_v=None)
    wide = T(np.zeros((B, S, H, DK + 1), np.float32))
    with pytest.raises(ValueError, match=r"^out: expected a last dim Dv with 1 <= Dv <= Dk=24, "
                                         r"got shape \[2, 3, 4, 25\]"):
        call(dict(good, out=wide, grad_out=wide), d_v=None)
    with pytest.raises(TypeError, match=r"^d_v: expected a Python int \(or out / grad_out"):
        call(dict(good, out=None, grad_out=None), d_v=None)


@pytest.mark.parametrize("value,got", [(-2, r"\[-2, "), (S_KV, rf", {S_KV}\]")])
def test_index_values(good, value, got):
    idx = good["token_indices"].numpy().copy()
    idx[1, 1, 2] = value
    bad = dict(good, token_indices=T(idx))
    with pytest.raises(ValueError, match=rf"^token_indices: expected values -1 \(empty slot\) or in \[0, S_kv=7\), got values in .*{got}"):
        call(bad)
    assert call(bad, values=False).S_kv == S_KV


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_sink_values(good, value):
    """NaN and +inf sinks are rejected (a NaN used to be masked into a finite output, +inf gives
    a NaN d_sink); -inf means "this head has no sink" and passes."""
    sink = good["attn_sink"].numpy().copy()
    sink[3] = value
    bad = dict(good, attn_sink=T(sink))
    with pytest.raises(
        ValueError,
        match=rf"^attn_sink: expected finite values or -inf .*NaN and \+inf are not allowed, "
        rf"got \[{value}\] at heads \[3\]",
    ):
        call(bad)
    assert call(bad, values=False).H == H  # the value read is what the flag skips
    sink[3] = -np.inf
    assert call(dict(good, attn_sink=T(sink))).H == H


def test_lse_values(good):
    """NaN in lse is rejected; +inf (FlashMLA's empty row) and -inf (ours) pass."""
    lse = good["lse"].numpy().copy()
    lse[0, 1, 2] = np.inf
    lse[1, 2, 0] = -np.inf
    assert call(dict(good, lse=T(lse))).H == H
    lse[1, 0, 1] = lse[0, 2, 3] = np.nan
    bad = dict(good, lse=T(lse))
    with pytest.raises(ValueError, match=r"^lse: expected no NaN .*got 2 NaN value\(s\)"):
        call(bad)
    assert call(bad, values=False).H == H


@pytest.mark.parametrize("name", ["out", "grad_out", "lse"])
def test_required_tensors(good, name):
    req = ("out", "grad_out", "lse")
    assert call(good, required=req).Dv == DV
    with pytest.raises(TypeError, match=rf"^{name}: expected a paddle.Tensor or torch.Tensor, got None"):
        call(dict(good, **{name: None}), required=req)
    # Not required: None means "not given".
    assert call(dict(good, **{name: None})).Dv == DV
    with pytest.raises(ValueError, match=r"^required: expected names among .*\['dq'\]"):
        call(good, required=("dq",))


def test_check_order(good):
    """The most basic problem wins: type > ndim > device > dtype > shape > d_v > values."""
    q = good["query"]
    # wrong ndim and wrong dtype: ndim is reported
    with pytest.raises(ValueError, match="^query: expected 4 dims"):
        call(dict(good, query=q.reshape([B, S, H * DK]).astype("float64")))
    # wrong dtype and wrong shape: dtype is reported
    with pytest.raises(TypeError, match="^attn_sink: expected dtype"):
        call(dict(good, attn_sink=T(np.zeros(H + 1, np.float64))))
    # wrong device and wrong dtype: device is reported
    with pytest.raises(ValueError, match="expected a tensor on cuda"):
        call(dict(good, lse=good["lse"].astype("float64")), device="cuda")
    # bad shape and bad d_v: shape is reported
    with pytest.raises(ValueError, match="^kv: expected"):
        call(dict(good, kv=T(np.zeros((B, S_KV, DK + 1), np.float32))), d_v=DK + 5)
    # bad d_v and bad index values: d_v is reported
    idx = good["token_indices"].numpy().copy()
    idx[0, 0, 0] = S_KV + 3
    with pytest.raises(ValueError, match="^d_v"):
        call({"query": q, "kv": good["kv"], "token_indices": T(idx)}, d_v=DK + 1)
    # a non-tensor beats everything
    with pytest.raises(TypeError, match="^lse: expected a paddle.Tensor"):
        call(dict(good, query=q.reshape([B, S, H * DK]), lse=[1.0]))


def test_mixed_frameworks(good):
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="all tensors must come from one framework"):
        call(dict(good, attn_sink=torch.zeros(H)))


def test_check_sm_scale():
    assert check_sm_scale(0.125) == 0.125 and isinstance(check_sm_scale(1), float)
    assert isinstance(check_sm_scale(np.float32(0.5)), float)
    for bad in (True, "0.1", None, np.array([0.1])):
        with pytest.raises(TypeError, match="^sm_scale: expected a Python float"):
            check_sm_scale(bad)
    # Positive and finite, also after rounding to float32 (the kernels' scalar): 1e39
    # overflows to inf, 1e-46 underflows to 0 there.
    assert check_sm_scale(1e38) == 1e38 and check_sm_scale(1e-44) == 1e-44
    for bad in (float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 0, -1.0, -1e-3, 1e39,
                1e-46, np.float64(1e300)):
        with pytest.raises(ValueError, match=r"^sm_scale: expected a finite float > 0"):
            check_sm_scale(bad)


def test_check_compute_dtype():
    assert check_compute_dtype("float32") == "float32"
    assert check_compute_dtype("float64") == "float64"
    with pytest.raises(ValueError, match="^dtype: expected 'float32' or 'float64', got 'bfloat16'"):
        check_compute_dtype("bfloat16")
    with pytest.raises(TypeError, match="^dtype: expected 'float32' or 'float64', got type"):
        check_compute_dtype(np.float32)


# --- packed documents: cu_seqlens and in-document indices --------------------------------------
def test_check_cu_seqlens_accepts_tensors_and_arrays():
    cu = np.array([0, 3, 3, 10], np.int32)
    for value in (cu, pytest.importorskip("paddle").to_tensor(cu)):
        got = check_cu_seqlens(value, 10)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, cu)
    assert check_cu_seqlens(cu)[-1] == 10  # no S given: any end


@pytest.mark.parametrize(
    "value,exc,pattern",
    [
        ([0, 4, 10], TypeError, "^cu_seqlens: expected an int32 paddle.Tensor, torch.Tensor or "
                                r"numpy.ndarray \[num_docs \+ 1\], got list"),
        (np.array([0, 4, 10], np.int64), TypeError, "^cu_seqlens: expected dtype int32, got int64"),
        (np.array([0.0, 4.0, 10.0]), TypeError, "^cu_seqlens: expected dtype int32, got float64"),
        (np.array([[0, 4, 10]], np.int32), ValueError,
         r"^cu_seqlens: expected 1 dim \[num_docs \+ 1\] with num_docs >= 1, got shape \[1, 3\]"),
        (np.array([0], np.int32), ValueError, r"^cu_seqlens: expected 1 dim.*got shape \[1\]"),
        (np.array([1, 4, 10], np.int32), ValueError,
         r"^cu_seqlens: expected cu_seqlens\[0\] == 0, got 1"),
        (np.array([0, 4, 6, 5, 10], np.int32), ValueError,
         r"^cu_seqlens: expected non-decreasing values, got cu_seqlens\[3\]=5 < cu_seqlens\[2\]=6 "
         r"\(document 2 would have length -1\)"),
        (np.array([0, 4, 9], np.int32), ValueError,
         r"^cu_seqlens: expected cu_seqlens\[-1\] == S=10 \(the packed rows\), got 9"),
        (np.array([0, 4, 11], np.int32), ValueError, r"^cu_seqlens: expected cu_seqlens\[-1\] == S=10"),
    ],
)
def test_check_cu_seqlens_errors(value, exc, pattern):
    with pytest.raises(exc, match=pattern):
        check_cu_seqlens(value, 10)


@pytest.mark.parametrize("framework", ["paddle", "torch"])
def test_check_indices_in_documents(rng, framework):
    mod = pytest.importorskip(framework)
    to_t = (lambda a: mod.to_tensor(a)) if framework == "paddle" else mod.from_numpy
    cu = np.array([0, 4, 4, 9, 16], np.int64)  # documents [0, 4), [4, 4) empty, [4, 9), [9, 16)
    S, L = 16, 5
    doc = np.repeat(np.arange(4), np.diff(cu))
    lo, hi = cu[doc][:, None], cu[doc + 1][:, None]
    # random keys of the row's own document, both ends included, and -1 slots
    idx = (lo + rng.integers(0, 1 << 20, (S, L)) % (hi - lo)).astype(np.int32)
    idx[rng.random((S, L)) < 0.3] = -1
    idx[4, 0], idx[8, 1], idx[9, 2], idx[15, 3] = 4, 8, 9, 15
    check_indices_in_documents(to_t(idx[None]), cu)
    check_indices_in_documents(to_t(idx[None].astype(np.int64)), cu)

    for row, key, d, rows in ((12, 8, 3, "[9, 16)"), (6, 9, 2, "[4, 9)"), (2, 4, 0, "[0, 4)"),
                              (5, 3, 2, "[4, 9)"), (0, 16, 0, "[0, 4)"), (7, -2, 2, "[4, 9)")):
        bad = idx.copy()
        bad[row, 1] = key
        bad[14, 4] = 0  # a second bad row, after the first: the message names the first
        with pytest.raises(ValueError, match=(
                rf"^token_indices: row {row} \(document {d}, rows {re.escape(rows)} of cu_seqlens\) "
                rf"holds key {key}, outside its document \(2 such row\(s\)\); with cu_seqlens every "
                r"index must be -1 or a row of the query's own document$")):
            check_indices_in_documents(to_t(bad[None]), cu)

    with pytest.raises(ValueError, match=r"^token_indices: packed documents need B=1.*\[2, 16, 5\]"):
        check_indices_in_documents(to_t(np.stack([idx, idx])), cu)
    with pytest.raises(ValueError, match=r"^token_indices: expected S = cu_seqlens\[-1\] = 16 rows"):
        check_indices_in_documents(to_t(idx[None, :15]), cu)
