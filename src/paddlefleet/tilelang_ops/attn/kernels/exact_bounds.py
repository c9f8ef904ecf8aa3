"""The deterministic backward's exactness proof, shared by both main backward kernels.

Each contribution ``c`` to key ``j`` is rounded onto the key's power-of-two grid,
``k = round(c / g_j)``, before the atomics add it; the sum is exact (and so order-free) while
every partial sum of a column stays within ``2^24``.  To prove that, each (row, head group,
slot) contribution also adds ``ceil(u)``, ``u = max_d |c_d / g_j|``, into ``Bound[b, j]`` (int64
atomics: exact) and the largest ``ceil(log2 max(u, 2^-120)) + 1`` into ``BoundExp[b, j]`` (an
atomic max, order-free too); the host re-runs the keys whose bound fails
(``exact_grid.rerun_plan``).
"""

from ... import settings

tilelang = settings.import_tilelang()
from tilelang import language as T  # noqa: E402

__all__ = ["slot_bound", "add_key_bounds", "to_grid", "slot_max", "add_slot_bound"]


# u above 2^24 already fails the bound; clamped at 2^40, n <= 2^23 of them sum
# exactly in int64.  BoundExp (a max, order-free too) covers the clamped ones: u <= 2^BoundExp.
U_CLAMP = float(2**40)
EXP_CLAMP = float(2**100)
U_FLOOR = float(2**-120)


@T.macro
def slot_bound(Bound, BoundExp, b_i, idx, u):
    """One (row, head group, slot) contribution's share of the exactness proof for key ``idx``
    (``>= 0``): ``ceil(u)`` into the int64 sum, the exponent of ``u`` into the max."""
    T.atomic_add(Bound[b_i, idx], T.Cast("int64", T.ceil(T.min(u, U_CLAMP))))
    T.atomic_max(BoundExp[b_i, idx], T.Cast("int32", T.ceil(
        T.log2(T.max(T.min(u, EXP_CLAMP), U_FLOOR)))) + 1)


@T.macro
def add_bounds(u_stage, Bound, BoundExp, Indices, b_i, s_i, k):
    """The atomics of :func:`add_key_bounds`, from each slot's ``u`` in ``u_stage [BK]``."""
    BK = u_stage.shape[0]
    for j in T.Parallel(BK):
        idx = Indices[b_i, s_i, k * BK + j]
        if idx >= 0:
            slot_bound(Bound, BoundExp, b_i, idx, u_stage[j])


@T.macro
def add_key_bounds(u_cols, u_frag, u_stage, Bound, BoundExp, Indices, b_i, s_i, k):
    """The proof for key block ``k`` (the one-role kernel, from its staged rows):
    ``u_cols [BK, CW/4]`` holds each slot's running max ``|c / g|`` per 4-column group; per
    slot with a key, one int64 add of ``ceil(u) >= max |k|`` (an exact sum) and the exponent of
    the largest ``u`` (``>= 2^-120``, which bounds ``u`` when a clamp makes the sum short and
    sizes a grid that was too coarse)."""
    T.reduce_max(u_cols, u_frag, dim=1)
    T.copy(u_frag, u_stage)
    add_bounds(u_stage, Bound, BoundExp, Indices, b_i, s_i, k)



# --- in registers: the 64-head first pass (bwd_two_warpgroups), which adds dKV straight from
# --- the wgmma accumulator; each thread holds two key rows (slots) of the block ---------------

@T.macro
def to_grid(v, o, inv_l, u_l, i):
    """``v[o:o + 4]`` (of the thread's slot ``i``) in grid units (``c / g_j``, exact: ``g_j`` a
    power of two), the slot's running max ``|c / g|`` in ``u_l[i]`` taken before the rounding
    (a grid too coarse still shows the size), then rounded."""
    for e in T.unroll(4):
        v[o + e] = v[o + e] * inv_l[i]
        u_l[i] = T.max(u_l[i], T.abs(v[o + e]))
        v[o + e] = T.round(v[o + e])


@T.macro
def slot_max(u_l):
    """Each slot's max over its row's four lanes ``t ^ {0, 1, 2, 3}`` (16 columns each)."""
    for i in T.unroll(2):
        u_l[i] = T.max(u_l[i], T.shfl_xor(u_l[i], 1))
        u_l[i] = T.max(u_l[i], T.shfl_xor(u_l[i], 2))


@T.macro
def add_slot_bound(u_l, slot, Bound, BoundExp, b_i, t):
    """The proof for the thread's two slots, once per row (by lane ``t % 4 == 0``)."""
    if t % 4 == 0:
        for i in T.unroll(2):
            if slot[i] >= 0:
                slot_bound(Bound, BoundExp, b_i, slot[i], u_l[i])
