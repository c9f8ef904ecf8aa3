"""The deterministic backward's exact dKV: each key's contributions summed on a power-of-two
grid of its own, so that the order in which CTAs add does not matter.

:func:`exact_dkv` runs the kernels (through a ``kernel_provider.KernelProvider``) for
``interface.mqa_latent_sparse_bwd(..., deterministic=True)``: a first-pass grid per key from a
deterministic guess (:func:`grid_estimate`), the first pass (with dq), then a re-run of the keys
whose proven bound says their grid was too fine or far too coarse.  ``dq`` is written once per
(row, head) by the CTA that owns it and ``d_sink`` is a fixed-order sum, so all three gradients
are bitwise identical across calls and processes.  ``docs/conventions.md`` has the proof and
states the precision.
"""

from __future__ import annotations

__all__ = ["exact_dkv", "grid_estimate", "EXACT_BITS", "GRID_MARGIN_BITS", "RERUN_COARSE_BITS",
           "GRID_EXP_RANGE"]

#: Every partial sum of one dKV column, counted in units of its key's grid, stays within
#: ``2**EXACT_BITS``: fp32 (24-bit significand) adds such integers exactly.
EXACT_BITS = 24
#: Head-room of the first pass's grid over its estimate of each key's sum (bits); a key whose
#: contributions are larger than that is re-run on a grid fitted to its exact bound.
GRID_MARGIN_BITS = 2
#: A key whose first-pass grid is this many bits (or more) coarser than its proven fit is re-run
#: on the finer grid too, so that a guess far too high never costs precision.
RERUN_COARSE_BITS = 6
#: Clamp of the grid exponent: keeps 1 / g a normal fp32 number.
GRID_EXP_RANGE = (-100, 100)


def grid_estimate(ops, provider, query, grad_out, pre, delta, lse2, kv, idx, sm_scale,
                  finish=None, groups=1):
    """``inv_grid [B, S_kv] fp32``: ``1 / g_j = 2**-e_j`` of the first pass's per-key grids, for
    ``query [B, S, H, Dk]`` and ``grad_out [B, S, H, Dv]`` (the real heads, contiguous) and
    ``idx [B, S, L]`` int32 (``-1``: no key); its first kernel (``grid_rows``) is also the
    deterministic backward's preprocess: from ``pre`` (``kernel_provider.FusedPreprocess``:
    ``out``, ``lse``, ``sink``, the lse format) it writes ``delta``, ``lse2`` and
    ``pre.d_sink_rows`` (``[B, S, H_pad] fp32``) as ``bwd_preprocess`` would.

    A deterministic guess of each key's sum of contributions if attention were uniform: a row
    ``s`` with ``L_s`` valid slots gives each key about ``c_s = 4 / L_s * sqrt(sum_h |dO_sh|^2
    ((sm_scale kv_rms |q_sh|)^2 / Dk + 1 / Dv))`` per column (the per-head terms of
    ``dS^T Q + P^T dO`` at ``P = 1 / L_s``, 4 for the largest of the Dk columns), in fp64 from
    the bf16 inputs (kernel ``grid_rows``, which streams ``out`` and ``dO`` for the preprocess
    anyway).  The sum over a key's rows ``E_j`` is taken
    in int64 fixed point, in units of ``2^-F`` with ``F = 40 - ceil(log2 max_s c_s)`` (exact,
    so order-free; ``grid_scatter``), and ``e_j = ceil(log2 E_j) - F + GRID_MARGIN_BITS -
    EXACT_BITS + ceil(log2 groups)``, clipped to ``GRID_EXP_RANGE`` (``grid_keys``).  ``groups``
    (the head groups per row, ``plan.num_groups``): each group's part of a row adds to the key
    as a contribution of its own, whose column maximum the bound counts separately, so the sum
    of the parts' bounds exceeds the row's (up to ``sqrt(groups)`` times for the norms,
    Cauchy-Schwarz; measured about twice at H=128, two groups: without the extra bit 83 keys
    re-ran, 0.75 ms, with 1.1 bits less head-room than at H=64); one bit per doubling of the groups keeps a single
    group's grids as they were.  Framework ops: the Frobenius
    norm of kv (``kv_rms`` is it over ``sqrt(numel)``), the largest ``c_s`` and a zeroed ``E``;
    no host sync.  Only
    speed depends on this guess: the kernel proves the bound for every key, and keys whose grid
    proves too fine (the bound fails) or too coarse (``RERUN_COARSE_BITS``) are re-run on a grid
    fitted to it.
    """
    b, s, _ = ops.shape(idx)
    _, s_kv, d_k = ops.shape(kv)
    kv_f = ops.cast(kv, "float32") if ops.device_kind(kv) == "cpu" else kv
    kv_norm = ops.row_norm(ops.reshape(kv_f, (1, -1)))  # [1] fp32: ||kv||_F
    # (sm_scale kv_rms)^2 / Dk = ||kv||_F^2 kv_coef (the kernel squares the norm in fp64)
    kv_coef = sm_scale * sm_scale / (max(1, b * s_kv * d_k) * d_k)
    c_row = ops.empty((b, s), "float64", idx)
    provider.exact_grid_rows(pre.natural, query, pre.out, grad_out, pre.lse, pre.sink, idx,
                             kv_norm, delta, lse2, pre.d_sink_rows, c_row, kv_coef)
    if finish is not None:
        # the deferred value checks: grid_rows only counts a row's slots >= 0; grid_scatter is
        # the first kernel that dereferences an index
        finish()
    top = ops.reshape(ops.amax(c_row), (1,))
    est = ops.zeros((b, s_kv), "int64", idx)
    provider.exact_grid_scatter(c_row, top, idx, est)
    inv_grid = ops.empty((b, s_kv), "float32", idx)
    provider.exact_grid_keys(est, top, inv_grid,
                             GRID_MARGIN_BITS - EXACT_BITS + (groups - 1).bit_length(),
                             *GRID_EXP_RANGE)
    return inv_grid


def exact_dkv(ops, provider, plan, q, kv, do, idx, lse2, delta, scale, dq, query, grad_out,
              pre, sm_scale, finish=None):
    """Deterministic dKV and dq, exact on per-key grids: returns ``(acc, inv_grid)``, the
    accumulator (fp32 ``[B, S_kv, Dk]``, in grid units, the provider's column order) and the
    inverse grids (fp32 ``[B, S_kv]``); ``dKV = acc / inv_grid`` (``bwd_finish``).  Writes
    ``lse2``, ``delta`` and ``pre.d_sink_rows`` first (the preprocess, in
    :func:`grid_estimate`'s first kernel).

    Pass 1 (``bwd_main``, deterministic, with dq) on the grids of :func:`grid_estimate` (from
    ``query`` and ``grad_out``, the real heads): every
    contribution ``c`` to key ``j`` becomes the integer ``k = round(c / g_j)`` and is added in
    fp32; the kernel also sums exactly, in int64,
    ``Bound_j = sum over contributions of ceil(u)``, ``u = max_d |c_d / g_j|`` taken before the
    rounding, and keeps ``BoundExp_j``, the largest ``ceil(log2 max(u, 2^-120)) + 1``.
    ``Bound_j <= 2^24`` bounds every partial sum of every column of key ``j`` by ``2^24`` grid
    units, so all those fp32 additions were exact and the result does not depend on their order.
    With ``U_j >= sum u`` (``Bound_j``, or ``S G 2^BoundExp_j`` if a ``u`` was clamped at
    ``2^40``), the grid ``g_j 2^-t`` keeps the bound for ``2^t U_j <= 2^24 - S G``; keys whose
    first grid was too fine (``Bound_j > 2^24``) or ``RERUN_COARSE_BITS`` or more too coarse
    are cleared and re-run (``with_dq=False``, on their slots only, moved to the front of each
    row) on the grid of the largest such ``t``: kernel ``rerun_plan`` decides per key (fp64,
    ``t`` from ``floor(log2)`` checked with an exact ``ldexp``) and clears the re-run keys'
    accumulator rows and flags each batch that has any (``any_over``), ``rerun_slots``
    compacts each row's slots (only in flagged batches: the rows of the others get ``counts =
    0`` and read nothing).  Everything stays on the device, no host sync, no data-dependent
    shape; a re-run with no keys costs near-empty launches.  ``docs/conventions.md`` has the
    proof.
    """
    b, s, l = ops.shape(idx)
    s_kv, d_k = ops.shape(kv)[1], ops.shape(kv)[2]
    if s * plan.num_groups > 2 ** (EXACT_BITS - 1):
        raise ValueError(
            f"query: S={s} x {plan.num_groups} head group(s) rows may add to one key, more than "
            f"the exact dKV accumulation proves (2^{EXACT_BITS - 1})")
    # the real heads; finish: the deferred value checks (see grid_estimate)
    inv_grid = grid_estimate(ops, provider, query, grad_out, pre, delta, lse2, kv, idx,
                              sm_scale, finish, plan.num_groups)
    acc = ops.zeros((b, s_kv, d_k), "float32", q)
    bound = ops.zeros((b, s_kv), "int64", q)
    bound_exp = ops.full((b, s_kv), -(2**30), "int32", q)  # atomic max: starts far below
    # the first pass (with dq) walks every slot and reads no counts
    provider.bwd_main(plan.heads_per_cta, True, True, q, kv, do, idx, lse2, delta, scale,
                      inv_grid, ops.empty((b, s), "int32", q), dq, acc, bound, bound_exp)

    # per key: re-run or not (over), the re-run grid (inv_grid *= 2^t), its accumulator cleared;
    # per batch: any key re-run (any_over: the plan only ever raises it, so it starts at 0)
    over = ops.empty((b, s_kv), "int32", q)
    any_over = ops.zeros((b,), "int32", q)
    provider.exact_rerun_plan(bound, bound_exp, inv_grid, acc, over, any_over,
                              float(s * plan.num_groups), EXACT_BITS, RERUN_COARSE_BITS)
    # the re-run keys' slots first in each row (stable), -1 after them to the end of their
    # 64-slot block and nothing past it; a row or batch with no re-run key: counts = 0 and idx2
    # left unwritten (the re-run reads a row's first ceil(counts / BK) key blocks only)
    idx2 = ops.empty((b, s, l), "int32", idx)
    counts = ops.empty((b, s), "int32", idx)
    provider.exact_rerun_slots(idx, over, any_over, idx2, counts)
    provider.bwd_main(plan.heads_per_cta, True, False, q, kv, do, idx2, lse2, delta, scale,
                      inv_grid, counts, dq, acc, bound, bound_exp)
    return acc, inv_grid
