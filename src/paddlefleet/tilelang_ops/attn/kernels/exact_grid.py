"""TileLang kernels of the deterministic backward's bookkeeping around the exact dKV passes.

``interface._exact_dkv`` sums each key's dKV exactly on a power-of-two grid of its own
(``docs/conventions.md``, "Determinism").  These small kernels choose the first pass's grids and,
after it, the keys to re-run, all on the device (no host sync, no data-dependent shape), in
launch order:

``grid_rows``     one CTA per query row ``(b, s)``: the deterministic backward's preprocess
                  (``Delta``, ``Lse2``, ``DSink`` per head, as ``bwd_preprocess.preprocess``
                  writes them for the atomic backward) and ``CRow[b, s] = 4 sqrt(sum_h |dO_sh|^2
                  (kscale |q_sh|^2 + 1 / Dv)) / max(1, n_valid)`` in fp64, ``kscale = KvNorm^2
                  kv_coef = (sm_scale kv_rms)^2 / Dk``, ``n_valid`` the row's slots with a key,
                  in one pass over ``out``, ``dO`` and ``q``.  The squares of the bf16 inputs
                  and every sum of them are fp64 (no overflow or underflow at any bf16
                  magnitude), added in a fixed order: repeatable bit for bit.
``grid_scatter``  one CTA per 16 query rows: each row's weight in int64 fixed point,
                  ``ceil(ldexp(CRow, frac_bits))`` with ``frac_bits = 40 - ceil(log2 top)``
                  (``top`` the largest ``CRow``, a framework ``amax``), added for each slot's
                  key into a histogram in shared memory (``S_kv <= 8192``; else straight), then
                  into ``Est[b, j]`` with int64 atomics (integer sums: exact, order-free).
``grid_keys``     one thread per key: ``e = ceil(log2 Est) - frac_bits + shift`` clipped to
                  ``[e_lo, e_hi]``, ``InvGrid = 2^-e`` (fp32, exact).
``rerun_plan``    after the first pass, one thread per key: from ``Bound``, ``BoundExp`` and
                  ``InvGrid``, whether the key re-runs (``Over``) and on which grid (``InvGrid``
                  scaled by ``2^t``), and its dKV accumulator row cleared if so; ``AnyOver[b]``
                  set when any key of batch ``b`` re-runs.
``rerun_slots``   a warp per query row: the slots whose key re-runs moved to the front of
                  each row in their order (``Idx2``), ``-1`` after them to the end of their
                  64-slot block, and how many (``Counts``); a row of a batch with no re-run key
                  (``AnyOver[b] = 0``) only gets ``Counts = 0``.

The formulas are those of the framework code they replace (``_exact_dkv``'s docstring, the
proof in ``docs/conventions.md``); ``tests/helpers.py::CpuStandIn`` has each one in numpy and
``tests/test_exact_grid.py`` holds them against the former framework version.  Runtime values
the tests vary (``GRID_MARGIN_BITS``, ``EXACT_BITS``, ``RERUN_COARSE_BITS``, the clip range,
``S * G``) are scalar kernel arguments, not compile-time constants.  Static: ``Dk``, ``Dv``,
threads.  Dynamic: ``B``, ``S``, ``H``, ``H_pad``, ``L``, ``S_kv``.  No kernel reads past a
tensor's end or dereferences a ``-1`` slot (or any index outside ``[0, S_kv)``).
"""

from ... import settings
from ..tiling import INDEX_PAD
from .bwd_preprocess import LOG2E, sink_lse2

tilelang = settings.import_tilelang()
from tilelang import language as T  # noqa: E402

__all__ = ["grid_rows", "grid_scatter", "grid_keys", "rerun_plan", "rerun_slots"]

# the fixed point puts the largest row weight at 2^FIX_TOP_BITS: sums of <= 2^22 rows stay
# below 2^63 (``S * G <= 2^23`` is checked by the caller)
FIX_TOP_BITS = 40.0
VEC = 8  # bf16 per 16-byte load
WARP = 32


@T.macro
def _frac_bits(top, frac):
    # 40 - ceil(log2 top), top > 0 (else 1): the fixed point's fractional bits, fp64
    frac[0] = FIX_TOP_BITS - T.ceil(T.log2(T.if_then_else(top > 0, top, T.float64(1))))


@T.macro
def _warp_sum(x):
    # butterfly: every lane ends with the same sum (each step adds a + b and b + a: equal)
    x[0] = x[0] + T.shfl_xor(x[0], 16)
    x[0] = x[0] + T.shfl_xor(x[0], 8)
    x[0] = x[0] + T.shfl_xor(x[0], 4)
    x[0] = x[0] + T.shfl_xor(x[0], 2)
    x[0] = x[0] + T.shfl_xor(x[0], 1)


@tilelang.jit(pass_configs=settings.PASS_CONFIGS)
def grid_rows(d_qk: int, d_v: int, natural: bool, threads: int = 128,
              heads_per_pass: int = 2):
    """The deterministic backward's preprocess and the rows' grid weights, in one pass over
    ``out``, ``dO`` and ``q`` (one CTA per query row ``(b, s)``).  Per real head ``h`` what
    ``bwd_preprocess.preprocess`` writes for the atomic backward: ``Delta = rowsum(O dO)``
    (fp32), ``Lse2`` (:func:`bwd_preprocess.sink_lse2`, ``natural`` as there),
    ``DSink = -2^(sink log2 e - Lse2) Delta``, and 0 in all three at the pad heads
    ``H <= h < H_pad``; per row ``CRow[b, s] = 4 sqrt(sum_h |dO_sh|^2 (kscale |q_sh|^2 + 1 /
    Dv)) / max(1, n_valid)`` in fp64 (``kscale = KvNorm^2 kv_coef = (sm_scale kv_rms)^2 / Dk``,
    ``n_valid`` the row's slots with a key: counted, never dereferenced).  Inputs
    ``Q [B, S, H, Dk]``, ``O``, ``dO [B, S, H, Dv]`` bf16 (the real heads), ``Lse [B, S, H]``,
    ``Sink [H]`` fp32 (``-inf``: no sink), ``Indices [B, S, L]``, ``KvNorm [1]`` fp32, the scalar ``kv_coef``; outputs ``Delta``,
    ``Lse2``, ``DSink [B, S, H_pad]`` fp32 and ``CRow [B, S]`` fp64.

    Why one kernel: the preprocess and the grid weights each streamed their inputs (``O`` and
    ``dO``, then ``q``) in a launch of their own, with ``|dO|^2`` handed between them in fp64;
    here each (row, head) is read once, 3.4 KB per head (0.42 ms at ``fleet`` against
    0.53 for the two launches, 0.23 against 0.29 at ``ref``).  Warp ``w`` of ``NW`` takes heads
    ``w, w + NW, ...`` (128 threads; one head per pass, 91 registers a thread left room for 5
    CTAs, 20 warps, per SM, two ~119 registers, 4 CTAs; 256 threads took 0.50 ms at
    ``fleet``), ``heads_per_pass`` of them at a time: each lane first issues all its 16-byte
    loads of those heads (``O``, ``dO`` and ``q``: independent, ~3.2 KB per head and warp in
    flight), then per head in turn multiplies (``O dO`` in fp32)
    and squares (``dO`` and ``q``, each bf16 value widened to fp64: exact, no overflow or
    underflow at any bf16 magnitude); butterflies give the head's three sums to every lane
    and lane 0 writes the head's values.  (Two heads per pass: 424 us against 436 at
    ``h128``, the same at ``ref`` and ``fleet``, 3.7-4.0 TB/s, so not limited by the loads in
    flight; bitwise the same outputs.)  The warps' weights and slot counts meet in shared
    memory and thread 0 adds them in warp order.  Every order is fixed: repeatable bit for
    bit."""
    assert d_qk % VEC == 0 and d_v % VEC == 0 and threads % WARP == 0
    NW = threads // WARP
    QV = d_qk // VEC  # 16-byte vectors per head row of q
    OV = d_v // VEC  # ... of O and dO
    QR = (QV + WARP - 1) // WARP  # per lane
    OR = (OV + WARP - 1) // WARP
    B = T.dynamic("B")
    S = T.dynamic("S")
    H = T.dynamic("H")
    H_pad = T.dynamic("H_pad")
    L = T.dynamic("L")

    @T.macro
    def load_vec(X, vec, j, i, b_i, s_i, h, lane):
        # the lane's i-th 16-byte vector of head row X[b, s, h, :] into vec[j VEC:(j + 1) VEC]
        for e in T.vectorized(VEC):
            vec[j * VEC + e] = X[b_i, s_i, h, (i * WARP + lane) * VEC + e]

    HP = heads_per_pass

    @T.prim_func
    def exact_grid_rows(
        Q: T.Tensor([B, S, H, d_qk], "bfloat16"),
        O: T.Tensor([B, S, H, d_v], "bfloat16"),
        dO: T.Tensor([B, S, H, d_v], "bfloat16"),
        Lse: T.Tensor([B, S, H], "float32"),
        Sink: T.Tensor([H], "float32"),
        Indices: T.Tensor([B, S, L], "int32"),
        KvNorm: T.Tensor([1], "float32"),
        Delta: T.Tensor([B, S, H_pad], "float32"),
        Lse2: T.Tensor([B, S, H_pad], "float32"),
        DSink: T.Tensor([B, S, H_pad], "float32"),
        CRow: T.Tensor([B, S], "float64"),
        kv_coef: T.float64,
    ):
        with T.Kernel(S, B, threads=threads) as (s_i, b_i):
            w_part = T.alloc_shared([NW], "float64")
            n_part = T.alloc_shared([NW], "int32")
            ov = T.alloc_local([HP * OR * VEC], "bfloat16")
            dv = T.alloc_local([HP * OR * VEC], "bfloat16")
            qv = T.alloc_local([HP * QR * VEC], "bfloat16")
            dl = T.alloc_local([1], "float32")
            d2 = T.alloc_local([1], "float64")
            q2 = T.alloc_local([1], "float64")
            sink2 = T.alloc_local([1], "float32")
            lse2 = T.alloc_local([1], "float32")
            w = T.alloc_local([1], "float64")
            n = T.alloc_local([1], "int32")
            kscale = T.alloc_local([1], "float64")
            tx = T.get_thread_binding()
            lane = tx % WARP
            warp = tx // WARP

            kscale[0] = T.Cast("float64", KvNorm[0]) * T.Cast("float64", KvNorm[0]) * kv_coef
            w[0] = 0
            for hh in T.serial(T.ceildiv(H, NW * HP)):
                # the warp's heads warp, warp + NW, ... in order, HP of them per pass: all
                # their loads first, then each head's sums in turn
                for p in T.unroll(HP):
                    if (hh * HP + p) * NW + warp < H:  # the same for the whole warp
                        for i in T.unroll(OR):
                            if i * WARP + lane < OV:
                                load_vec(O, ov, p * OR + i, i, b_i, s_i, (hh * HP + p) * NW + warp,
                                         lane)
                                load_vec(dO, dv, p * OR + i, i, b_i, s_i,
                                         (hh * HP + p) * NW + warp, lane)
                        for i in T.unroll(QR):
                            if i * WARP + lane < QV:
                                load_vec(Q, qv, p * QR + i, i, b_i, s_i, (hh * HP + p) * NW + warp,
                                         lane)
                for p in T.unroll(HP):
                    h = (hh * HP + p) * NW + warp
                    if h < H:  # the same for the whole warp: its shuffles stay whole
                        dl[0] = 0
                        d2[0] = 0
                        q2[0] = 0
                        for i in T.unroll(OR):
                            if i * WARP + lane < OV:
                                for e in T.unroll(VEC):
                                    dl[0] = dl[0] + T.Cast(
                                        "float32", ov[(p * OR + i) * VEC + e]) * T.Cast(
                                        "float32", dv[(p * OR + i) * VEC + e])
                                    d2[0] = d2[0] + T.Cast(
                                        "float64", dv[(p * OR + i) * VEC + e]) * T.Cast(
                                        "float64", dv[(p * OR + i) * VEC + e])
                        for i in T.unroll(QR):
                            if i * WARP + lane < QV:
                                for e in T.unroll(VEC):
                                    q2[0] = q2[0] + T.Cast(
                                        "float64", qv[(p * QR + i) * VEC + e]) * T.Cast(
                                        "float64", qv[(p * QR + i) * VEC + e])
                        _warp_sum(dl)
                        _warp_sum(d2)
                        _warp_sum(q2)
                        w[0] = w[0] + d2[0] * (kscale[0] * q2[0] + 1.0 / d_v)
                        if lane == 0:
                            sink2[0] = Sink[h] * LOG2E
                            lse2[0] = sink_lse2(Lse[b_i, s_i, h], sink2[0], natural)
                            Delta[b_i, s_i, h] = dl[0]
                            Lse2[b_i, s_i, h] = lse2[0]
                            DSink[b_i, s_i, h] = -T.exp2(sink2[0] - lse2[0]) * dl[0]
            for p in T.serial(T.ceildiv(H_pad - H, threads)):
                if H + p * threads + tx < H_pad:
                    Delta[b_i, s_i, H + p * threads + tx] = 0.0
                    Lse2[b_i, s_i, H + p * threads + tx] = 0.0
                    DSink[b_i, s_i, H + p * threads + tx] = 0.0
            n[0] = 0
            for i in T.serial(T.ceildiv(L, threads)):
                if i * threads + tx < L:
                    if Indices[b_i, s_i, i * threads + tx] >= 0:
                        n[0] = n[0] + 1
            _warp_sum(n)
            if lane == 0:
                w_part[warp] = w[0]
                n_part[warp] = n[0]
            T.sync_threads()
            if tx == 0:
                for k in T.serial(1, NW):
                    w_part[0] = w_part[0] + w_part[k]
                    n_part[0] = n_part[0] + n_part[k]
                CRow[b_i, s_i] = 4.0 * T.sqrt(w_part[0]) / T.Cast(
                    "float64", T.max(n_part[0], 1))

    return exact_grid_rows


@tilelang.jit(pass_configs=settings.PASS_CONFIGS)
def grid_scatter(threads: int = 256, rows: int = 16, keys: int = 8192, rounds: int = 8):
    """``Est [B, S_kv] int64 += ceil(ldexp(CRow[b, s], frac_bits))`` for every slot of row
    ``(b, s)`` with a key (``Indices`` in ``[0, S_kv)``), ``frac_bits = 40 - ceil(log2 Top[0])``
    (``Top[0] > 0``, else 1).  Integer sums: exact, so the order does not matter.  ``Est``
    must be zeroed by the caller.

    One CTA per ``rows`` rows, whose slots are one contiguous run of ``Indices``; each pass
    loads ``rounds`` slots per thread before it adds any (independent loads).  For ``S_kv <=
    keys`` it adds each slot's row weight into a histogram of the keys in shared memory (int64
    atomics there), then the histogram's nonzero entries into ``Est`` with coalesced int64
    atomics: one global atomic per slot to a random key took 0.14 ms at ``fleet`` (5.2 M
    slots) and 0.16 at ``ref``, the histogram 0.05 and 0.07 (``rows`` 16).  For more
    keys each slot adds into ``Est`` directly (three ranges of the histogram, each reading
    the slots again, were slower than that at ``S_kv = 20000``)."""
    PASS = rounds * threads
    assert keys % threads == 0 and rows <= threads
    B = T.dynamic("B")
    S = T.dynamic("S")
    L = T.dynamic("L")
    S_kv = T.dynamic("S_kv")

    @T.prim_func
    def exact_grid_scatter(
        CRow: T.Tensor([B, S], "float64"),
        Top: T.Tensor([1], "float64"),
        Indices: T.Tensor([B, S, L], "int32"),
        Est: T.Tensor([B, S_kv], "int64"),
    ):
        with T.Kernel(T.ceildiv(S, rows), B, threads=threads) as (r_blk, b_i):
            hist = T.alloc_shared([keys], "int64")
            c_s = T.alloc_shared([rows], "int64")  # the rows' weights in fixed point
            frac = T.alloc_local([1], "float64")
            slot = T.alloc_local([rounds], "int32")
            row = T.alloc_local([1], "int32")
            w = T.alloc_local([rounds], "int64")
            tx = T.get_thread_binding()
            s0 = r_blk * rows
            n = T.min(rows, S - s0) * L  # this CTA's slots: Indices[b, s0:, :] flattened
            _frac_bits(Top[0], frac)
            if tx < rows:
                c_s[tx] = 0
                if s0 + tx < S:
                    c_s[tx] = T.Cast("int64", T.ceil(T.ldexp(CRow[b_i, s0 + tx],
                                                             T.Cast("int32", frac[0]))))
            if S_kv <= keys:  # the whole key range in the histogram (the same for every CTA)
                for i in T.serial(keys // threads):
                    hist[i * threads + tx] = 0
            T.sync_threads()
            for ps in T.serial(T.ceildiv(n, PASS)):
                for r in T.unroll(rounds):
                    slot[r] = -1
                    w[r] = 0
                    if ps * PASS + r * threads + tx < n:
                        row[0] = T.truncdiv(ps * PASS + r * threads + tx, L)  # >= 0
                        slot[r] = Indices[b_i, s0 + row[0],
                                          ps * PASS + r * threads + tx - row[0] * L]
                        w[r] = c_s[row[0]]
                for r in T.unroll(rounds):
                    # a key (-1 and out-of-range values never are); adding 0 changes nothing
                    if slot[r] >= 0 and slot[r] < S_kv and w[r] != 0:
                        if S_kv <= keys:
                            T.atomic_add(hist[slot[r]], w[r])
                        else:
                            T.atomic_add(Est[b_i, slot[r]], w[r])
            if S_kv <= keys:
                T.sync_threads()
                for i in T.serial(keys // threads):
                    if i * threads + tx < S_kv:
                        if hist[i * threads + tx] != 0:
                            T.atomic_add(Est[b_i, i * threads + tx], hist[i * threads + tx])

    return exact_grid_scatter


@tilelang.jit(pass_configs=settings.PASS_CONFIGS)
def grid_keys(threads: int = 256):
    """``InvGrid [B, S_kv] fp32 = 2^-e``, ``e = clip(ceil(log2 Est') - frac_bits + shift, e_lo,
    e_hi)`` with ``Est' = Est`` (as fp64) where positive, else 1, and ``frac_bits`` from
    ``Top`` as in :func:`grid_scatter`; ``shift = GRID_MARGIN_BITS - EXACT_BITS`` (+ one per
    doubling of a row's head groups, ``interface._grid_estimate``) and the clip
    range are scalar arguments.  One thread per key."""
    B = T.dynamic("B")
    S_kv = T.dynamic("S_kv")

    @T.prim_func
    def exact_grid_keys(
        Est: T.Tensor([B, S_kv], "int64"),
        Top: T.Tensor([1], "float64"),
        InvGrid: T.Tensor([B, S_kv], "float32"),
        shift: T.int32,
        e_lo: T.int32,
        e_hi: T.int32,
    ):
        with T.Kernel(T.ceildiv(S_kv, threads), B, threads=threads) as (k_blk, b_i):
            frac = T.alloc_local([1], "float64")
            est = T.alloc_local([1], "float64")
            e = T.alloc_local([1], "float64")
            tx = T.get_thread_binding()
            j = k_blk * threads + tx
            if j < S_kv:
                _frac_bits(Top[0], frac)
                est[0] = T.Cast("float64", Est[b_i, j])
                e[0] = (T.ceil(T.log2(T.if_then_else(est[0] > 0, est[0], T.float64(1))))
                        - frac[0] + T.Cast("float64", shift))
                e[0] = T.min(T.max(e[0], T.Cast("float64", e_lo)), T.Cast("float64", e_hi))
                InvGrid[b_i, j] = T.Cast("float32", T.ldexp(T.float64(1), T.Cast("int32", -e[0])))

    return exact_grid_keys


@tilelang.jit(pass_configs=settings.PASS_CONFIGS)
def rerun_plan(d_qk: int, block_keys: int = 64, threads: int = 256):
    """After the exact first pass, per key ``j`` of batch ``b`` (``interface._exact_dkv`` has
    the proof), in fp64:

    * ``U = Bound (1 + 2^-50)`` (an upper bound despite the rounding) or, when a ``u`` was
      clamped (``Bound >= 2^40``) or it is tighter, ``n_max 2^BoundExp``;
    * ``t`` the largest integer with ``2^t U <= room = 2^exact_bits - n_max`` (``floor(log2(room
      / U))``, less one where ``ldexp(U, t) > room``: whatever log2 rounded to);
    * ``Over = Bound > 0 and (Bound > 2^exact_bits or t >= coarse_bits)`` (int32 0/1);
    * for an over key ``InvGrid *= 2^t`` and its row of ``Acc [B, S_kv, Dk]`` is zeroed;
    * ``AnyOver [B] int32`` (zeroed by the caller) becomes 1 where batch ``b`` has an over key
      (an atomic max from each over key's thread: the value does not depend on their order),
      so that :func:`rerun_slots` can skip the batches with none.

    ``n_max = S G`` (fp64), ``exact_bits``, ``coarse_bits`` are scalar arguments.  A CTA takes
    ``block_keys`` keys: one thread each decides, then the CTA clears the over keys' rows with
    16-byte stores."""
    assert d_qk % 4 == 0 and block_keys <= threads
    KB = block_keys
    B = T.dynamic("B")
    S_kv = T.dynamic("S_kv")

    @T.prim_func
    def exact_rerun_plan(
        Bound: T.Tensor([B, S_kv], "int64"),
        BoundExp: T.Tensor([B, S_kv], "int32"),
        InvGrid: T.Tensor([B, S_kv], "float32"),
        Acc: T.Tensor([B, S_kv, d_qk], "float32"),
        Over: T.Tensor([B, S_kv], "int32"),
        AnyOver: T.Tensor([B], "int32"),
        n_max: T.float64,
        exact_bits: T.int32,
        coarse_bits: T.int32,
    ):
        with T.Kernel(T.ceildiv(S_kv, KB), B, threads=threads) as (k_blk, b_i):
            over_s = T.alloc_shared([KB], "int32")
            bound = T.alloc_local([1], "float64")
            by_max = T.alloc_local([1], "float64")
            u = T.alloc_local([1], "float64")
            room = T.alloc_local([1], "float64")
            t = T.alloc_local([1], "float64")
            over = T.alloc_local([1], "int32")
            tx = T.get_thread_binding()
            j0 = k_blk * KB
            if tx < KB:
                over[0] = 0
                if j0 + tx < S_kv:
                    bound[0] = T.Cast("float64", Bound[b_i, j0 + tx]) * (1.0 + 2.0**-50)
                    by_max[0] = T.ldexp(n_max, BoundExp[b_i, j0 + tx])
                    u[0] = T.if_then_else(bound[0] >= 2.0**40, by_max[0],
                                          T.min(by_max[0], bound[0]))
                    if bound[0] > 0:  # a key with no nonzero contribution is exact as it is
                        room[0] = T.ldexp(T.float64(1), exact_bits) - n_max
                        t[0] = T.floor(T.log2(room[0] / u[0]))
                        if T.ldexp(u[0], T.Cast("int32", t[0])) > room[0]:
                            t[0] = t[0] - 1
                        if (bound[0] > T.ldexp(T.float64(1), exact_bits)
                                or t[0] >= T.Cast("float64", coarse_bits)):
                            over[0] = 1
                            T.atomic_max(AnyOver[b_i], 1)  # rare: over keys are few
                            InvGrid[b_i, j0 + tx] = T.Cast("float32", T.ldexp(
                                T.Cast("float64", InvGrid[b_i, j0 + tx]), T.Cast("int32", t[0])))
                    Over[b_i, j0 + tx] = over[0]
                over_s[tx] = over[0]
            T.sync_threads()
            for j, d in T.Parallel(KB, d_qk):
                if over_s[j] != 0:  # only keys < S_kv are ever marked
                    Acc[b_i, j0 + j, d] = 0

    return exact_rerun_plan


@tilelang.jit(pass_configs=settings.PASS_CONFIGS)
def rerun_slots(threads: int = 256, rounds: int = 8, block: int = INDEX_PAD):
    """``Idx2 [B, S, L]``: each row's slots whose key re-runs (``Over[b, Indices] != 0``) first,
    in their order, ``-1`` after them up to the end of the ``block``-slot block that holds the
    last (the re-run reads whole key blocks, the first ``ceil(Counts / BK)``, and every key
    block ``BK`` divides ``block = tiling.INDEX_PAD``); ``Counts [B, S]`` how many.  ``Idx2``
    past that block, and all of a row with ``Counts = 0``, is left as it was (unwritten): the
    re-run reads none of it.

    A warp per row, ``threads / 32`` rows per CTA, no CTA barrier: each lane loads ``rounds``
    slots of a pass and their keys' flags first (independent loads), then per round a warp
    ballot gives each flagged slot its place.  (A CTA walking 8 rows with two CTA barriers per
    pass and ``-1`` written over every row's whole tail took 60 us at ``fleet`` where it finds
    two slots: docs/log.md.)

    ``AnyOver [B] int32`` (from :func:`rerun_plan`): a row of a batch with no re-run key
    (``AnyOver[b] = 0``; most of the benchmark's calls re-run one or two keys) reads
    neither ``Indices`` nor ``Over`` and only gets ``Counts = 0``.  The flag is per batch and
    a warp owns one row: the whole warp takes the same branch (its ballots stay whole)."""
    assert threads % WARP == 0
    NW = threads // WARP  # rows per CTA
    R = rounds
    PASS = R * WARP
    B = T.dynamic("B")
    S = T.dynamic("S")
    L = T.dynamic("L")
    S_kv = T.dynamic("S_kv")

    @T.prim_func
    def exact_rerun_slots(
        Indices: T.Tensor([B, S, L], "int32"),
        Over: T.Tensor([B, S_kv], "int32"),
        AnyOver: T.Tensor([B], "int32"),
        Idx2: T.Tensor([B, S, L], "int32"),
        Counts: T.Tensor([B, S], "int32"),
    ):
        with T.Kernel(T.ceildiv(S, NW), B, threads=threads) as (r_blk, b_i):
            slot = T.alloc_local([R], "int32")
            flag = T.alloc_local([R], "int32")
            mask = T.alloc_local([R], "uint32")
            base = T.alloc_local([1], "int32")  # the row's flagged slots so far: every lane
            end = T.alloc_local([1], "int32")
            tx = T.get_thread_binding()
            lane = tx % WARP
            s_i = r_blk * NW + tx // WARP
            base[0] = 0
            if s_i < S:  # the same for the whole warp
                if AnyOver[b_i] != 0:  # the same for the whole warp: one batch
                    for ps in T.serial(T.ceildiv(L, PASS)):
                        for r in T.unroll(R):
                            slot[r] = -1
                            if ps * PASS + r * WARP + lane < L:
                                slot[r] = Indices[b_i, s_i, ps * PASS + r * WARP + lane]
                        for r in T.unroll(R):
                            flag[r] = 0
                            if slot[r] >= 0 and slot[r] < S_kv:
                                flag[r] = T.if_then_else(Over[b_i, slot[r]] != 0, 1, 0)
                        for r in T.unroll(R):
                            mask[r] = T.Cast("uint32", T.ballot(flag[r] != 0))
                            if flag[r] != 0:  # after the flagged slots of lower lanes
                                Idx2[b_i, s_i, base[0] + T.Cast("int32", T.popcount(
                                    mask[r] & ((T.uint32(1) << T.Cast("uint32", lane))
                                               - T.uint32(1))))] = slot[r]
                            base[0] = base[0] + T.Cast("int32", T.popcount(mask[r]))
                    # -1 from Counts to the end of its block (none at Counts = 0)
                    end[0] = T.min(T.ceildiv(base[0], block) * block, L)
                    for i in T.serial(T.ceildiv(block, WARP)):
                        if base[0] + i * WARP + lane < end[0]:
                            Idx2[b_i, s_i, base[0] + i * WARP + lane] = -1
                if lane == 0:
                    Counts[b_i, s_i] = base[0]

    return exact_rerun_slots
