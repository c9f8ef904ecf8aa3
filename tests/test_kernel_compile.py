"""CPU tests of the TileLang kernels' compilation (no GPU): every kernel lowers for
``settings.TARGET`` (sm_90a) with the shared settings, what is compiled has the aggressive
shared-memory merge off, and, where ``nvcc`` exists, the lowered CUDA compiles to a cubin.

Lowering costs 10-60 s per kernel on 2 cores, so only a handful of specialisations are built
(the names and arguments come from ``attn.kernels.specs``, the registry every launcher uses):
the 64-head forward (the reference shape), the 64-head backward main kernel in the
deterministic exact mode (first pass with dQ, and the re-run without), the 16-head atomic
backward (the other key block) and the preprocess; and the exact dKV's five small bookkeeping
kernels (``exact_grid.py``, a second or two each), each held to what makes it fast and safe:
16-byte loads, int64 atomics, warp ballots, runtime scalar arguments, and every global read or
write of a data-dependent index behind its bounds check.  Every lowered kernel hands registers
between its warpgroups as it asks (``setmaxnreg``), and where ``nvcc`` exists ptxas must not
serialise its wgmma (warning C7514).
Runs under tilelang-paddle 0.1.13 (CI) and mainline TileLang 0.1.15; skipped when TileLang is
not installed.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from paddlefleet.tilelang_ops import settings
from paddlefleet.tilelang_ops.attn.kernels import main_args, pre_args
from paddlefleet.tilelang_ops.attn.kernels.schedule import (TwoWarpgroupSchedule, bwd_schedule,
                                                             fwd_schedule, two_warpgroup_schedule)

pytestmark = pytest.mark.skipif(
    settings.tilelang_flavour() is None or importlib.util.find_spec("tilelang") is None,
    reason="TileLang is not installed",
)

MERGE = "tl.enable_aggressive_shared_memory_merge"
SMEM_LIMIT = 232448  # bytes of dynamic shared memory per block on H100/H200
KERNEL_DIR = Path(__file__).resolve().parent.parent / "src/paddlefleet/tilelang_ops/attn/kernels"


#: one lowering per (specialisation, effective pass configs) and process: several tests read the
#: same kernel (the natural-log preprocess alone takes a minute of CPU)
_CACHE = {}


def _lower(name, args, pass_configs=None):
    from paddlefleet.tilelang_ops.attn import kernels

    cfg = kernels._jit(name, args).pass_configs if pass_configs is None else pass_configs
    key = (name, args, tuple(sorted(cfg.items())))
    if key not in _CACHE:
        _CACHE[key] = kernels.lower(name, args, pass_configs)
    return _CACHE[key]


def _named(name, args):
    from paddlefleet.tilelang_ops.attn import kernels

    return kernels.named(name, args)


def _smem(art):
    (f,) = [f for _, f in art.device_mod.functions.items()]
    attrs = f.attrs
    return int(attrs["dyn_shared_memory_buf"]) if "dyn_shared_memory_buf" in attrs else 0


def _layout(art):
    """``{shared buffer: byte offset}`` in the generated kernel."""
    pat = r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\)"
    return dict((n, int(o)) for n, o in re.findall(pat, art.kernel_source))


def _specs(pair=(576, 512), want=None):
    from paddlefleet.tilelang_ops.attn import kernels

    # bwd_main: (tile, deterministic, with dQ) and, fused, (fused, natural)
    want = want or [("fwd", 64), ("bwd_main", (64, True, True)), ("bwd_main", (64, True, False)),
                    ("bwd_main", (16, False, True)), ("bwd_main", (64, False, True, True, True)),
                    ("bwd_main", (64, False, True, True, False)), ("bwd_pre", True)]

    def tag(name, args):
        a = kernels.named(name, args)
        if name == "bwd_pre":
            return name, a["natural"]
        if name == "fwd":
            return name, a["heads_per_cta"]
        if name == "bwd_main":
            fused = (True, a["natural"]) if a.get("fused") else ()
            return name, (a["heads_per_cta"], a["deterministic"], a["with_dq"]) + fused
        return name, None

    by_tag = {tag(n, a): (n, a) for n, a in kernels.specs(pairs=(pair,))}
    return [by_tag[w] for w in want]  # in this order: the first three go through nvcc


SPECS = _specs() if settings.tilelang_flavour() is not None else []
#: (Dk, Dv) = (512, 512) (DeepSeek-V4: no rope tail) specialisations lowered here, a few for
#: CI's time (every one: ``tools/kernel_digests.py --dims 512x512 --ptxas``): the 64-head
#: forward (P_0's own buffer), the 16-head one-role backward and the 64-head atomic first
#: pass (warpgroup 0's chunk a latent one)
SPECS_512 = _specs((512, 512), [("fwd", 64), ("bwd_main", (16, False, True)),
                                ("bwd_main", (64, False, True, True, True))]) if SPECS else []
#: the names of the rope tail's buffers and fragments in the lowered CUDA (each kernel's own)
TAIL_BUFFERS = re.compile(r"\b(Q_tail|Q_tail_shared|K_tail_shared|KV_tail_shared|K_t|K_t0|K_t1|"
                          r"Q_t|acc_dq_t|acc_dq_tail|acc_dkv_tail|dkv_tail_stage)\b")
EXACT_GRID = ("grid_rows", "grid_scatter", "grid_keys", "rerun_plan", "rerun_slots")


def _grid_specs():
    from paddlefleet.tilelang_ops.attn import kernels

    got = {}
    for n, a in kernels.specs():  # grid_rows: one per lse format; the first (natural) here
        if n in EXACT_GRID:
            got.setdefault(n, (n, a))
    assert sorted(got) == sorted(EXACT_GRID), got
    return list(got.values())


GRID_SPECS = _grid_specs() if settings.tilelang_flavour() is not None else []
MAIN64 = ("bwd_main", main_args(64, True, True))
RERUN64 = ("bwd_main", main_args(64, True, False))
#: the 64-head atomic first pass as the wrappers launch it: the preprocess fused in
MAIN64_ATOMIC = ("bwd_main", main_args(64, False, True, fused=True))


def test_settings_keep_the_merge_off():
    assert settings.PASS_CONFIGS == {MERGE: False}
    assert settings.TARGET == {"kind": "cuda", "arch": "sm_90a"}


def test_every_kernel_takes_the_shared_pass_configs():
    from paddlefleet.tilelang_ops.attn import kernels

    jits = tuple(kernels.builders().values())
    for jit in jits:
        assert jit.pass_configs is settings.PASS_CONFIGS
    # no kernel file carries its own copy of a pass config
    decorators = []
    for path in KERNEL_DIR.glob("*.py"):
        text = path.read_text()
        assert "PassConfigKey" not in text and "aggressive" not in text.lower(), path.name
        decorators += re.findall(r"@tilelang\.jit\(([^)]*)\)", text)
    assert len(decorators) == len(jits)
    assert all(d == "pass_configs=settings.PASS_CONFIGS" for d in decorators), decorators


def _spec_id(name, args):
    a = _named(name, args)
    if name == "bwd_pre":
        return f"{name}_{a['d_v']}_{a['natural']}"
    parts = [name, str(a["heads_per_cta"])]
    if name == "bwd_main":
        parts += ["exact" if a["deterministic"] else "atomic", str(a["with_dq"])]
        if a.get("fused"):
            parts.append("fused_natural" if a["natural"] else "fused_log2")
    if a["d_qk"] != 576:
        parts.append(str(a["d_qk"]))
    return "_".join(parts)


@pytest.mark.parametrize("name, args", SPECS + SPECS_512,
                         ids=[_spec_id(n, a) for n, a in SPECS + SPECS_512])
def test_kernel_lowers_for_sm90a(name, args):
    art = _lower(name, args)
    src = art.kernel_source
    a = _named(name, args)
    assert "__global__" in src
    assert _smem(art) <= SMEM_LIMIT
    if "d_qk" in a:
        # the rope tail's buffers exist iff Dk > Dv: at (512, 512) nothing of it is built
        assert bool(TAIL_BUFFERS.search(src)) == (a["d_qk"] > a["d_v"]), (
            TAIL_BUFFERS.findall(src))
    if name in ("fwd", "bwd_main") and a["heads_per_cta"] == 64:
        assert "wgmma" in src, "the 64-head kernels should use Hopper wgmma"
    _assert_register_handover(src)
    if name == "bwd_main":
        # 16-byte atomics; the atomic mode's 64-head first pass as predicated reds (pred_red)
        red = a["heads_per_cta"] == 64 and not a["deterministic"] and a["with_dq"]
        assert ("pf_red_add_v4_if((" if red else "AtomicAddx4((") in src, (
            "the vectorised dKV scatter is missing")
        assert ("AtomicAddx4((" in src) != red, "one form of dKV atomic per kernel"
        exact = a["deterministic"]
        # the exact mode rounds onto the key's grid and proves its bound with int64 adds
        assert ("nearbyintf" in src) == exact and ("Bound" in src) == exact
        assert ("dQ + " in src) == a["with_dq"], "dQ is written by the first pass only"
        if not a["with_dq"]:
            # the re-run reads a row's slots only in its ceil(Counts / BK) key blocks, none at
            # Counts = 0: rerun_slots writes a row's Idx2 only up to the end of the block of its
            # last re-run slot and leaves the rows of batches without a re-run key unwritten.
            # On its fixed grid a CTA loads the Counts of up to 256 of its rows (bx + (c 256 +
            # tx) RERUN_CTAS: bounds-checked) into shared memory, ORs them > 0 with one barrier
            # and walks those rows only if one is set, each from its shared count
            bk = a["schedule"].block_k
            assert re.search(rf"int num_blocks = \(\(cnt_s\[r\] \+ {bk - 1}\) >> "
                             rf"{bk.bit_length() - 1}\);", src)
            assert _guarded(src, "Counts[", ["((c * 256) + ((int)threadIdx.x)) < "],
                            before=200) == 1
            assert re.search(r"cnt_s\[\(\(int\)threadIdx\.x\)\] = Counts\[", src)
            assert src.count("__syncthreads_or(") == 1
            assert re.search(r"for \(int r = 0; r < \w+; \+\+r\) \{\s+if \(0 < cnt_s\[r\]\)",
                             src)
            spans = [sp for opener in ("if (0 < num_blocks) {", "if (1 <= num_blocks) {",
                                       "for (int k = 0; k < (num_blocks - 1); ++k) {")
                     for sp in _blocks(src, opener)]
            assert _all_inside(src, "Indices[", spans)


def _assert_register_handover(src):
    """A warp-specialised kernel's ``setmaxnreg`` raises (``warpgroup_reg_alloc``) take no more
    registers than its lowering (``warpgroup_reg_dealloc``) give back, from the launch's share
    ``65536 / threads`` (rounded down to 8): one asking for more waits forever (run 56: a
    forward trial hung with 192 / 232 / 80 registers, 96 x 128 asked, 88 x 128 freed)."""
    ups = [int(n) for n in re.findall(r"warpgroup_reg_alloc<(\d+)>", src)]
    downs = [int(n) for n in re.findall(r"warpgroup_reg_dealloc<(\d+)>", src)]
    if not ups and not downs:
        return
    threads = int(re.search(r"__launch_bounds__\((\d+)", src).group(1))
    share = min(65536 // threads, 255) // 8 * 8
    assert sum(u - share for u in ups) <= sum(share - d for d in downs), (share, ups, downs)


def test_forward_consumers_take_alternate_blocks():
    """The 64-head forward (``sparse_fwd._warp_specialized``, consumers on alternate key blocks):
    each consumer multiplies its own ``P`` from registers (an RS wgmma each), the producer reads
    the indices only in its two row loads per pair (``async_copy.load_key_rows``, both blocks'
    rows ahead of the pair's first wait), its registers are handed over as asked (224 / 224 / 56,
    216 / 216 / 72 with ``consumer_regs=216``: the knob reaches the kernel), and
    ``scale2`` is set before the warpgroups split: run 74 set it in warpgroup 0's branch only,
    and warpgroup 1's softmax weights came out NaN."""
    (name, args), = [(n, a) for n, a in SPECS if n == "fwd"]
    src = _lower(name, args).kernel_source
    assert src.count("wgmma_rs<") == 2
    split = src.index("if (((int)threadIdx.x) < 128) {")
    assert re.search(r"scale2\[0\] = \(Scale\[0\]", src[:split])
    producer = src[src.index("warpgroup_reg_dealloc"):]
    assert producer.count("Indices[") == 2
    assert re.findall(r"warpgroup_reg_(?:de)?alloc<(\d+)>", src) == ["224", "224", "56"]
    src216 = _lower(name, args + (replace(fwd_schedule(), consumer_regs=216),)).kernel_source
    assert re.findall(r"warpgroup_reg_(?:de)?alloc<(\d+)>", src216) == ["216", "216", "72"]


def test_forward_without_rope_tail_gives_p0_a_buffer_of_its_own():
    """The 64-head forward hands warpgroup 0's ``P`` to warpgroup 1 through key buffer 0's rope
    tail (``[BK, Dk - Dv] = [64, 64]``, free once the block's scores are done); at (Dk, Dv) =
    (512, 512) there is no tail, and ``P_0`` is a ``[64, 64]`` bf16 buffer of its own, apart
    from every other buffer (a shared byte would let the producer's next gather overwrite P
    while warpgroup 1 reads it).  The registers are handed over as at (576, 512)."""
    (name, args), = [(n, a) for n, a in SPECS_512 if n == "fwd"]
    art = _lower(name, args)
    src = art.kernel_source
    lay = _layout(art)
    assert "P_0" in lay and "K_t0" not in src, sorted(lay)
    ends = sorted(set(lay.values()) | {_smem(art)})
    p0 = lay["P_0"]
    assert ends[ends.index(p0) + 1] - p0 >= 64 * 64 * 2
    assert list(lay.values()).count(p0) == 1
    assert re.findall(r"warpgroup_reg_(?:de)?alloc<(\d+)>", src) == ["224", "224", "56"]
    assert src.count("wgmma_rs<") == 2


def _role_barrier_ids(src):
    """The named-barrier ids (``__sync_thread_partial(id, count)``) in each warpgroup role of a
    warp-specialised kernel: the block of ``threadIdx.x < 128``, then, in what follows it, the
    block of ``threadIdx.x < 256`` (the forward's second consumer) and the rest (its producer,
    or the backward's warpgroup 1)."""
    ids = lambda text: set(re.findall(r"__sync_thread_partial\((\d+), \d+\)", text))
    a, b = max(_blocks(src, "if (((int)threadIdx.x) < 128) {"), key=lambda s: s[1] - s[0])
    roles, rest = [ids(src[a:b])], src[b:]
    inner = _blocks(rest, "if (((int)threadIdx.x) < 256) {")
    if inner:
        c, d = max(inner, key=lambda s: s[1] - s[0])
        roles.append(ids(rest[c:d]))
        rest = rest[:c] + rest[d:]
    roles.append(ids(rest))
    return roles


@pytest.mark.parametrize("kernel", ["fwd64", "main64_exact", "main64_atomic_fused"])
def test_named_barriers_belong_to_one_role(kernel):
    """No named barrier id serves two warpgroup roles: ``bar.sync id, 128`` completes once any
    128 threads arrive, so a producer and a consumer that both use id 3 can release each other's
    barriers (the persistent forward trial, runs 103-105: TileLang gave the barrier it inserted
    into the producer the id of warpgroup 0's own).  The shipped kernels' TileLang barriers:
    3 in warpgroup 0, 4 in the forward's warpgroup 1, none in the forward's producer or the
    backward's warpgroup 1 (code before the roles split is not looked at)."""
    name, args = {"fwd64": ("fwd", (64, 576, 512)), "main64_exact": MAIN64,
                  "main64_atomic_fused": MAIN64_ATOMIC}[kernel]
    src = _lower(name, args).kernel_source
    roles = _role_barrier_ids(src)
    assert len(roles) == (3 if name == "fwd" else 2)
    # the pattern still matches TileLang's spelling (else every set would be empty)
    assert roles[0] == {"3"}, roles
    for i, r in enumerate(roles):
        assert "0" not in r, (i, r)
        for other in roles[i + 1:]:
            assert not r & other, roles


@pytest.mark.parametrize("kernel", ["fwd64", "main64_exact", "main64_atomic_fused", "fwd64_512",
                                    "main64_atomic_fused_512"])
def test_head_tiles_come_by_tma(kernel):
    """The 64-head kernels load their query tile (and the backward its dO tile) by TMA, with the
    transaction bytes of the whole tile expected on the one barrier every thread then waits for,
    and no ``cp.async`` of those tiles: issued as 4,608 16-byte ``cp.async`` by 384 threads, the
    forward's tile took 3.4 us of a 61 us CTA just to issue (runs 108-109's timelines; TMA, run
    110: -4 to -5% at ``ref``, -13% at ``fleet``).  The bytes expected must add up to the tile, or the barrier
    would release early (a short count) or never (a long one)."""
    import re

    name, args = {"fwd64": ("fwd", (64, 576, 512)), "main64_exact": MAIN64,
                  "main64_atomic_fused": MAIN64_ATOMIC, "fwd64_512": SPECS_512[0],
                  "main64_atomic_fused_512": SPECS_512[-1]}[kernel]
    d_qk, d_v = _named(name, args)["d_qk"], _named(name, args)["d_v"]
    assert kernel.endswith("_512") == (d_qk == 512)
    src = _lower(name, args).kernel_source
    tiles = ("Q",) if name == "fwd" else ("Q", "dO")
    for t in tiles:
        assert f"tma_load({t}_desc, q_ready[0]" in src, t
    # the query tile in 64-column boxes: nine with the rope tail, eight without
    assert src.count("tma_load(Q_desc, q_ready[0]") == d_qk // 64
    expected = sum(int(n) for n in re.findall(r"q_ready\[0\]\.expect_transaction\((\d+)\)", src))
    assert expected == 64 * (d_qk + (d_v if name != "fwd" else 0)) * 2, expected
    # the tiles' cp.async path (async_copy.load_head_tile) is gone: no 16-byte piece of them
    assert not re.search(r"cp_async_gs<16>\([^;]*\(&\((Q|dO)\[", src)


@pytest.mark.parametrize("regs", [160, 220, 248])
def test_forward_consumer_regs_outside_the_register_file_are_refused(regs):
    """``consumer_regs`` below 168 (the launch's share) or above 240 (a producer below 24) or off
    the multiples of 8 would give ``setmaxnreg`` values that hang or are illegal (run 56: a raise
    above what the others gave back waited forever); the builder refuses them."""
    from paddlefleet.tilelang_ops.attn.kernels import sparse_fwd

    with pytest.raises(AssertionError, match="consumer_regs"):
        sparse_fwd._warp_specialized(64, 576, 512, replace(fwd_schedule(), consumer_regs=regs))


def _guarded(src, access, guards, before=600):
    """Every ``access`` (e.g. ``"Over["``, not ``"AnyOver["``: the name whole) in ``src`` has
    each of ``guards`` in the ``before`` characters ahead of it (the bounds check of its
    ``if``)."""
    sites = _sites(src, access)
    assert sites, access
    for at in sites:
        window = src[max(0, at - before):at]
        missing = [g for g in guards if g not in window]
        assert not missing, (access, missing, src[max(0, at - before):at + 80])
    return len(sites)


def _sites(src, access):
    """Offsets of every ``access`` in ``src``, the name whole (``"Over["`` is not in
    ``"AnyOver["``)."""
    return [m.start() for m in re.finditer(r"(?<!\w)" + re.escape(access), src)]


def _all_inside(src, access, spans):
    """Whether ``access`` occurs in ``src`` and every occurrence lies inside one of ``spans``
    (from :func:`_blocks`)."""
    sites = _sites(src, access)
    return bool(sites) and all(any(a < at < b for a, b in spans) for at in sites)


def _blocks(src, opener):
    """``(start, end)`` of every ``opener`` (an ``if (...) {``) in ``src`` to its closing brace."""
    spans = []
    for m in re.finditer(re.escape(opener), src):
        depth, i = 1, m.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(src[i], 0)
            i += 1
        spans.append((m.start(), i))
    return spans


def _signature(src, name):
    return re.search(rf"__global__ void __launch_bounds__\(\d+, 1\) {name}_kernel\(([^)]*)\)",
                     src).group(1)


@pytest.mark.parametrize("name, args", GRID_SPECS, ids=[n for n, _ in GRID_SPECS])
def test_exact_grid_kernel_lowers_for_sm90a(name, args):
    """The exact dKV's bookkeeping kernels lower for sm_90a with at most a few words of shared
    memory (``grid_scatter``: its histogram of 8192 int64 keys too), with what each is for,
    the margins and bit counts as runtime scalar arguments (the tests vary them), and no read
    or write through a data-dependent index without its check: a slot's key is used only in
    ``[0, S_kv)`` (never ``-1``), a row's slots only below ``L``, a key only below ``S_kv``."""
    art = _lower(name, args)
    src = art.kernel_source
    assert "__global__" in src
    assert _smem(art) <= 256 + (8192 * 8 if name == "grid_scatter" else 0), _smem(art)
    sig = _signature(src, "exact_" + name)
    for idx_read in ("Indices[",):
        if idx_read in src:
            _guarded(src, idx_read, ["< L)"])
    if name == "grid_rows":
        # the deterministic backward's preprocess too: 16-byte loads of each head row of O, dO
        # and q, O dO in fp32, the squares of dO and q in fp64, four butterflies (Delta, |dO|^2,
        # |q|^2, the count); Delta, Lse2 and DSink written per head
        for vec, t in (("ov", "O"), ("dv", "dO"), ("qv", "Q")):
            assert re.search(rf"\*\(uint4\*\)\({vec} \+ [^=;]*= \*\(uint4\*\)\({t} \+ ", src), vec
            assert f"bfloat16_t* __restrict__ {t}," in sig
        assert "(((double)dv[" in src and "(((double)qv[" in src and "(((float)ov[" in src
        assert src.count("__shfl_xor_sync") == 20
        for out in ("Delta", "Lse2", "DSink"):
            assert f"float* __restrict__ {out}" in sig and src.count(f"{out}[") == 2, out
        assert "DO2" not in src
        assert "double kv_coef" in sig and "sqrt(" in src
    elif name == "grid_scatter":
        # a slot adds its row's weight only for a key in [0, S_kv) (-1 never is): into the
        # shared histogram (S_kv <= 8192) or straight into Est; the histogram into Est for keys
        # below S_kv
        assert _guarded(src, "AtomicAdd((&(((int64_t*)hist)[", ["(0 <= slot[", "< S_kv)"],
                        before=200) == 1
        assert _guarded(src, "AtomicAdd((&(Est[", ["< S_kv)"], before=250) == 2
        # the direct path (S_kv > 8192): the slot's own lower bound too (never Est[b, -1])
        direct = [at for at in _sites(src, "AtomicAdd((&(Est[")
                  if "hist)[" not in src[at:at + 200]]
        assert len(direct) == 1 and "(0 <= slot[" in src[direct[0] - 200:direct[0]]
        assert src.count("if (S_kv <= 8192) {") == 3
        assert "ceil(ldexp(CRow[" in src and "ceil(log2(" in src
    elif name == "grid_keys":
        assert all(f"int {a}" in sig for a in ("shift", "e_lo", "e_hi"))
        _guarded(src, "InvGrid[", ["< S_kv)"], before=1500)
        assert "ldexp(0x1p+0" in src and "ceil(log2(" in src
    elif name == "rerun_plan":
        assert "double n_max" in sig and "int exact_bits" in sig and "int coarse_bits" in sig
        for access in ("Bound[", "BoundExp[", "InvGrid[", "Over["):
            _guarded(src, access, ["< S_kv)"], before=3000)
        # over keys' accumulator rows cleared with 16-byte stores, only keys below S_kv
        _guarded(src, "*(float4*)(Acc + ", ["over_s[", "< S_kv)"])
        assert "floor(log2(" in src and "ldexp(u[0]" in src
        # the per-batch flag: raised (atomic max, order-free) by over keys only
        assert "int* __restrict__ AnyOver" in sig and "const int* __restrict__ AnyOver" not in sig
        assert _guarded(src, "AtomicMax((&(AnyOver[", ["coarse_bits) <= t[0])"], before=200) == 1
        _guarded(src, "AtomicMax((&(AnyOver[", ["< S_kv)"], before=3000)
    else:
        assert "__ballot_sync(0xFFFFFFFFu" in src and "__popc(" in src
        _guarded(src, "Over[", ["(0 <= slot[", "< S_kv)"])
        assert "Idx2[" in src and "Counts[" in src
        # a batch without a re-run key (flag 0) reads no index or key flag and writes no slot:
        # every such access is inside an if on the flag
        assert "const int* __restrict__ AnyOver" in sig
        spans = _blocks(src, "if (AnyOver[((int64_t)((int)blockIdx.y))] != 0) {")
        assert spans
        for access in ("Indices[", "Over[", "Idx2["):
            assert _all_inside(src, access, spans), access
        # a warp per row: Counts written once per row, by lane 0, outside the flag's branch
        # (its count there, 0 otherwise); the -1 after the re-run slots only to the end of
        # their block (end = min(ceil(count / 64) 64, L))
        assert len(_sites(src, "Counts[")) == 1 and not _all_inside(src, "Counts[", spans)
        assert "end[0] = min((((base[0] + 63) >> 6) * 64), L);" in src
        assert _guarded(src, "Idx2[", ["< L)"], before=400) == 2
        assert "__syncthreads()" not in src


@pytest.mark.parametrize("name, args", [MAIN64, RERUN64], ids=["main64_exact", "rerun64_exact"])
def test_compiled_kernel_has_the_merge_off(name, args):
    """The build with the shared settings is the build TileLang makes from the kernel's own
    pass configs, and every shared buffer in it has bytes nobody else uses: the Q tile, loaded
    before the key loop (the aliasing behind the NaN dQ/dKV of TileLang 0.1.9-0.1.10), and in
    the two-warpgroup 64-head kernel every buffer, since the warpgroups use them at the same
    time (a liveness-based merge cannot see that).  Where the merge would move something (the
    one-role kernel), forcing it on changes the layout: flipping the setting in settings.py
    changes (and fails) this test."""
    default = _lower(name, args)
    explicit_off = _lower(name, args, settings.pass_configs(**{MERGE: False}))
    assert _layout(default) == _layout(explicit_off)
    if not _named(name, args)["with_dq"]:
        forced_on = _lower(name, args, settings.pass_configs(**{MERGE: True}))
        assert _layout(default) != _layout(forced_on), (
            "the shared-memory layout does not depend on the merge setting: is it still applied?"
        )
    lay = _layout(default)
    assert [n for n in lay if n.startswith("Q_")], sorted(lay)
    for buf, b0 in lay.items():
        b1 = min([o for o in lay.values() if o > b0] + [_smem(default)])
        assert not [n for n, o in lay.items() if n != buf and b0 <= o < b1], buf


@pytest.mark.parametrize("kernel", ["exact", "atomic", "atomic_512"])
def test_two_warpgroup_kernel_retires_ds_k_before_refilling_k_l(kernel):
    """Warpgroup 0 of the 64-head first pass issues ``dQ_l += dS K_l`` as an async wgmma, then
    gathers the next block's keys into ``K_l`` by ``cp.async``; it is ``K_l``'s only reader and
    writer, so no barrier guards it and the wgmma must be retired in between.  At (576, 512) the
    rope tail's GEMM waited for it; at (512, 512) there is no tail GEMM, and without a wait of
    its own the refill raced the wgmma (a static review found it: dQ's left half wrong, and
    not repeatable)."""
    name, args = {"exact": MAIN64, "atomic": MAIN64_ATOMIC, "atomic_512": SPECS_512[-1]}[kernel]
    src = _lower(name, args).kernel_source
    ds_k = re.search(r"initialize_wgmma_descriptor<[^>]*>\(desc_a_\d+, \(&\(\(\(bfloat16_t\*\)dS_s\)"
                     r"\[0\]\)\)\);\s*tl::initialize_wgmma_descriptor<[^>]*>\(desc_b_\d+, "
                     r"\(&\(\(\(bfloat16_t\*\)K_l\)\[0\]\)\)\);", src)
    assert ds_k, "no dS x K_l wgmma found"
    refill = src.index("cp_async_gs_conditional<16>((&(((bfloat16_t*)K_l)", ds_k.end())
    # (T.gemm's own wait prints as warpgroup_wait, T.wait_wgmma's as wait_wgmma: one PTX
    # instruction, wgmma.wait_group 0)
    assert re.search(r"tl::(warpgroup_wait|wait_wgmma)<0>\(\);", src[ds_k.end():refill]), (
        src[ds_k.end():refill])


@pytest.mark.parametrize("mode", ["exact", "atomic", "atomic_512"])
def test_two_warpgroup_kernel_scatters_every_dkv_chunk(mode):
    """The 64-head first pass adds each 64-column dKV chunk from the accumulator of the
    warpgroup that computed it, at the permuted columns of ``tiling.dkv_column``, with the
    16-byte atomics (``schedule.two_warpgroup_schedule``).  Exact mode: two chunks on
    warpgroup 0 (the right half's last, the rope tail), the left half's loop and the right
    half's on warpgroup 1, each lane's own float4s (four lanes per key row).  Atomic mode: the
    rope tail on warpgroup 0, warpgroup 1's eight chunks unrolled over two accumulators
    (``overlap``), eight lanes per key row (lanes ``t`` and ``t ^ 4`` trade half of their
    float4s, and each other's slot).  A dropped or misplaced scatter leaves a wrong dKV and no
    error.  The two warpgroups synchronise through mbarriers and 128-thread named barriers only:
    a CTA-wide barrier inside one warpgroup's branch would hang.  (The kernels as the wrappers
    launch them: the atomic one with the preprocess fused.)  At (Dk, Dv) = (512, 512) there is
    no rope tail: warpgroup 0 adds the right half's last ``wg0_chunks`` chunks instead, and the
    two warpgroups' chunks are every column once."""
    name, args = {"exact": MAIN64, "atomic": MAIN64_ATOMIC, "atomic_512": SPECS_512[-1]}[mode]
    if mode.endswith("_512"):
        assert _spec_id(name, args) == "bwd_main_64_atomic_True_fused_natural_512"
        mode = mode.removesuffix("_512")
    d_qk, d_v = _named(name, args)["d_qk"], _named(name, args)["d_v"]
    schedule = _named(name, args)["schedule"]
    assert schedule == two_warpgroup_schedule(mode == "exact")
    assert schedule == (TwoWarpgroupSchedule(2, False, 4, False) if mode == "exact"
                        else TwoWarpgroupSchedule(1, True, 8, True))
    wg0_chunks, overlap = schedule.wg0_chunks, schedule.overlap
    row_lanes, pred_red = schedule.row_lanes, schedule.pred_red
    has_tail = d_qk > d_v
    wg0_right = wg0_chunks - has_tail  # warpgroup 0's chunks of the right half (the last ones)
    src = _lower(name, args).kernel_source
    branch = src.index("if (((int)threadIdx.x) < 128)")
    wg1 = src.index("pds_full[0].wait(")

    def stmt(i):
        return src[i:src.index(";", i)]

    sites = [m.start() for m in re.finditer(r"AtomicAddx4\(\(&\(dKV_acc\[|pf_red_add_v4_if\(\(",
                                            src)]
    # the atomic mode's are predicated reds (no branch around them, ptx.RED_V4_SRC):
    # predicate and address from the same row (-1 and rows past S_kv add nothing), the offset
    # from the batch's first row
    red = (r"pf_red_add_v4_if\(\(\(0 <= (row_\d+)\) && \(\1 < S_kv\)\), \(&\(dKV_acc\[\(\(\(\("
           rf"int64_t\)\(\(int\)blockIdx\.y\)\) \* \(\(int64_t\)S_kv\)\) \* \(int64_t\){d_qk}\)\]\)\), "
           rf"\(+\(int64_t\)max\(\1, 0\)\) \* \(int64_t\){d_qk}\)")
    assert all(bool(re.match(red, stmt(i))) == pred_red for i in sites)
    assert ("@q red.relaxed.gpu.global.add.v4.f32" in src) == pred_red
    w0 = [i for i in sites if branch < i < wg1]
    w1 = [i for i in sites if i > wg1]
    assert len(w0) + len(w1) == len(sites)
    # lane t adds at 16 c + 4 (t % 4) (+ 16 for the odd quad of a pair: 4 (t % 8))
    lane = "& (int64_t)3) * (int64_t)4)" if row_lanes == 4 else "& (int64_t)7) * (int64_t)4)"
    assert all(lane in stmt(i) for i in sites)
    if row_lanes == 4:
        # one loop (or site) per macro call
        assert len(w0) == (wg0_right > 0) + has_tail and len(w1) == 2, (w0, w1)
        assert all("slot[" in stmt(i) for i in sites)
        assert "__shfl_xor_sync((uint)4294967295, condval" not in src
    else:
        def col(i):
            m = re.search(r"\+ \(int64_t\)(\d+)\)(?:\]\)\), \(&\(r4\[0\]\)|, r4\[0\], r4\[1\], "
                          r"r4\[2\], r4\[3\]\))", stmt(i))
            return int(m.group(1)) if m else 0

        # two atomics per row pair and chunk (the even quad's row, then the odd one's): the
        # right half's last wg0_right chunks, then the tail, on warpgroup 0, warpgroup 1's
        # chunks one after another; together every column once
        w0_cols = list(range(d_v - 64 * wg0_right, d_v, 64)) + ([d_v] if has_tail else [])
        w1_cols = list(range(0, d_v - 64 * wg0_right, 64))
        assert [col(i) for i in w0] == [c for c in w0_cols for _ in (0, 1)]
        assert [col(i) for i in w1] == [c for c in w1_cols for _ in (0, 1)]
        assert sorted(w0_cols + w1_cols) == list(range(0, d_qk, 64))
        assert all(re.search(rf"row_[eo\d]+(?:, 0\))?\) \* \(int64_t\){d_qk}", stmt(i))
                   for i in sites)
        # one exchange per chunk (4 floats by lane t ^ 4), the partner's slots once per block
        assert len(re.findall(r"r4\[\(\w+ \+ 12\)\] = __shfl_xor_sync\(\(uint\)4294967295, "
                              r"condval_\d+, 4, 32\)", src)) == len(sites) // 2
        assert len(re.findall(r"slot\[\((\w+) \+ 2\)\] = __shfl_xor_sync\(\(uint\)4294967295, "
                              r"slot\[\1\], 4, 32\)", src)) == 2
    # the copies are the wgmma fragment's columns 2 q + {0, 1, 8, 9} of each 16: local indices
    # 8 c + 2 h + {0, 1, 4, 5} (four lanes per row), or, eight lanes per row, those of the even
    # and of the odd 16-column groups apart, 16 k + 2 h + {0, 1, 4, 5} and + 8: each warpgroup's
    # from its own accumulators
    mask, step, shift = ("3", "8", "2") if row_lanes == 4 else ("1", "16", "1")
    copies = re.findall(rf"(v(?:_\d+)?)\[(\w+)\] = (acc_w[01]b?)\[\(?\(\(\(\2 & {mask}\) \* "
                        rf"{step}\) \+ \(\(\2 >> {shift}\) \* 2\)\)(?: \+ (\d+)\))?\]", src)
    # the local offset of the copy that feeds r4[first + m]
    first, want_off = (0, [0, 1, 4, 5]) if row_lanes == 4 else (4, [0, 1, 4, 5, 8, 9, 12, 13])
    accs = ("acc_w0", "acc_w1") + (("acc_w1b",) if overlap else ())
    got = {acc: {int(o or 0) for _, _, a, o in copies if a == acc} for acc in accs}
    assert got == {acc: set(want_off) for acc in accs}, got
    assert len({a for _, _, a, _ in copies}) == len(accs)
    # ... and each copy feeds the float4 lane it belongs to: r4[0:4] (or, eight lanes per row,
    # the own row's two groups r4[4:8] and r4[8:12]) in the fragment's column order
    off_of = {}
    for name, _, _, o in copies:
        off_of.setdefault(name, set()).add(int(o or 0))
    assert all(len(v) == 1 for v in off_of.values()), off_of
    feeds = re.findall(r"r4\[(\d+)\] = (v(?:_\d+)?)\[\w+\];", src)
    assert feeds and all(off_of[n] == {want_off[int(k) - first]} for k, n in feeds), feeds
    if row_lanes == 8:
        # the exchange, lane t ^ 4 the partner (odd: lane t & 4 set, the pair's second quad):
        # the odd lane sends its group 2 k, the even one its group 2 k + 1; the even row's atomic
        # takes the even lane's own group 2 k and the odd lane's received one, at the even
        # quad's slot; the odd row's the even lane's received and the odd lane's group 2 k + 1,
        # at the odd quad's slot; the column's 32 k from the loop's low bit, the row from >> 1
        flat = re.sub(r"\s+", "", src)
        odd = r"if\(\(\(\(\(\(int\)threadIdx\.x\)&7\)>>2\)==1\)\)"
        sel = r"\{{(condval_\d+)=r4\[\((\w+)\+{0}\)\];\}}else\{{\1=r4\[\(\2\+{1}\)\];\}}"
        n = len(sites) // 2
        send = odd + sel.format(4, 8) + (r"r4\[\(\2\+12\)\]=__shfl_xor_sync\(\(uint\)4294967295,"
                                         r"\1,4,32\);")
        data_e = odd + sel.format(12, 4) + r"r4\[\2\]=\1;"
        data_o = odd + sel.format(8, 12) + r"r4\[\2\]=\1;"
        hi, lo = r"\(\(\w+>>1\)\+2\)", r"\(\w+>>1\)"
        # (with pred_red the row is the red's argument, named row_N)
        row = (r"int(condval_\d+);" + odd + r"\{{\1=slot\[{1}\];\}}else\{{\1=slot\[{2}\];\}}"
               r"int(?:{0}|row)(?:_\d+)?=\1;")
        row_e, row_o = row.format("row_e", hi, lo), row.format("row_o", lo, hi)
        for pat in (send, data_e, data_o, row_e, row_o):
            assert len(re.findall(pat, flat)) == n, pat
        assert all("& (int64_t)1) * (int64_t)32)" in stmt(i) for i in sites)
    assert "__syncthreads()" not in src[branch:]
    # warpgroup 0's four warps write P / dS and then read all their rows in the dQ GEMM: only
    # TileLang's 128-thread barrier (id 3, warpgroup 0's own) orders that
    ds_store = src.rindex("dS_s)[", 0, src.index("pds_full[0].arrive()"))
    dq_gemm = src.index("(bfloat16_t*)dS_s)[0]", ds_store)
    assert "__sync_thread_partial(3, 128)" in src[ds_store:dq_gemm]
    assert "__sync_thread_partial(3, 128)" not in src[wg1:]
    if mode == "exact":
        # each slot's maximum over its row's four lanes (in each warpgroup that adds chunks);
        # warpgroup 0's slot maxima reach warpgroup 1's bound: stored, signalled, waited for,
        # combined; then one int64 add and one max per slot
        for lane in (1, 2):
            assert len(re.findall(rf"u_l\[(\w+)\] = max\(u_l\[\1\], __shfl_xor_sync\("
                                  rf"\(uint\)4294967295, u_l\[\1\], {lane}, 32\)\)", src)) == (
                2 if wg0_chunks else 1)
        assert bool(re.search(r"\(\(float\*\)u_w0\)\[[^\n]*\] = u_l\[\w+\];", src)) == bool(
            wg0_chunks)
        assert ("u_ready[0].arrive()" in src and "u_ready[0].wait(" in src) == bool(wg0_chunks)
        assert bool(re.search(r"u_l\[(\w+)\] = max\(u_l\[\1\], \(\(float\*\)u_w0\)",
                              src)) == bool(wg0_chunks)
        assert "AtomicAdd((&(Bound[" in src and "AtomicMax((&(BoundExp[" in src


#: ptxas' spill stores / loads (bytes, nvcc 13.0, sm_90a) of the (576, 512) kernels as shipped:
#: a ceiling, not a target (a new spill is a regression to look at before it ships); every
#: other kernel spills nothing.  A (512, 512) twin (no rope tail: fewer registers live) may
#: not spill more than its (576, 512) kernel.
SPILL_CEILING = {"main64_exact": (44, 52), "main64_atomic_fused": (12, 12)}
_CUBIN_IDS = (["fwd64", "main64_exact", "main64_rerun", "main64_atomic_fused", "pre"]
              if SPECS else []) + [n for n, _ in GRID_SPECS] + (
              ["fwd64_512", "main64_atomic_fused_512"] if SPECS else [])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("name, args", SPECS[:3] + SPECS[4:5] + SPECS[-1:] + GRID_SPECS
                         + SPECS_512[:1] + SPECS_512[2:3], ids=_CUBIN_IDS)
def test_lowered_source_compiles_to_cubin(name, args, tmp_path, request):
    from kernel_digests import nvcc_cubin, ptxas_stats  # tools/ (pytest.ini)

    cu = tmp_path / f"{name}.cu"
    cu.write_text(_lower(name, args).kernel_source)
    res = nvcc_cubin(cu, tmp_path / f"{name}.cubin", timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (tmp_path / f"{name}.cubin").stat().st_size > 0
    # ptxas serialises every wgmma of a kernel when it cannot prove an accumulator untouched
    # while its wgmma runs (e.g. one left in flight across a loop's back edge: a forward trial
    # of this session); it says so only in this warning
    assert "C7514" not in res.stderr, res.stderr[-3000:]
    stats = ptxas_stats(res.stderr)
    print(stats)
    twin = request.node.callspec.id.removesuffix("_512")
    ceiling = SPILL_CEILING.get(twin, (0, 0))
    assert stats["spill_st"] <= ceiling[0] and stats["spill_ld"] <= ceiling[1], (stats, ceiling)


def test_two_warpgroup_schedule_defaults_by_mode():
    """``schedule.two_warpgroup_schedule``: the atomic mode overlaps its dKV chunks with the
    rope tail on warpgroup 0 and eight lanes per row, the exact mode keeps two chunks there, one
    accumulator and four lanes; the atomic mode's atomics are predicated ``red`` instructions.
    A record that leaves warpgroup 0 no chunk (the overlapped list would end in the rope tail,
    which gave a wrong dKV) or another lane count is refused; the main kernels' arguments
    carry the records (``kernels.main_args``)."""
    assert two_warpgroup_schedule(False) == TwoWarpgroupSchedule(
        wg0_chunks=1, overlap=True, row_lanes=8, pred_red=True)
    assert two_warpgroup_schedule(True) == TwoWarpgroupSchedule(
        wg0_chunks=2, overlap=False, row_lanes=4, pred_red=False)
    with pytest.raises(ValueError, match="wg0_chunks"):
        TwoWarpgroupSchedule(wg0_chunks=0, overlap=False, row_lanes=8, pred_red=True)
    with pytest.raises(ValueError, match="row_lanes"):
        TwoWarpgroupSchedule(wg0_chunks=1, overlap=True, row_lanes=2, pred_red=True)
    assert main_args(64, True, True)[-3:] == (two_warpgroup_schedule(True), False, True)
    for m in (16, 32, 64):  # the one-role kernel: the 16- and 32-head tiles, every re-run
        assert main_args(m, True, False)[-1] == bwd_schedule(m)
    assert bwd_schedule(64).dkv_transposed and not bwd_schedule(32).dkv_transposed
    assert (bwd_schedule(16).block_k, bwd_schedule(32).block_k) == (64, 32)


def test_main_args_reach_the_fused_parameters():
    """``kernels.main_args(..., fused=True)`` gives the two-warpgroup kernel's ``fused`` and
    ``natural`` (by name: ``kernels.named``); a head tile whose first pass has no fused
    prologue, or a re-run, is refused instead of building a kernel without it."""
    from paddlefleet.tilelang_ops.attn import kernels

    for natural in (True, False):
        got = kernels.named("bwd_main", main_args(64, False, True, fused=True, natural=natural))
        assert got["fused"] is True and got["natural"] is natural
        assert got["deterministic"] is False and got["with_dq"] is True
        assert got["schedule"] == two_warpgroup_schedule(False)
    assert main_args(16, False, True) == (16, 576, 512, False, True, bwd_schedule(16))
    for m, with_dq in ((32, True), (64, False)):
        with pytest.raises(ValueError, match="fused"):
            main_args(m, False, with_dq, fused=True)


@pytest.mark.parametrize("mode, natural", [("atomic", True), ("exact", False)])
def test_fused_prologue_computes_the_rows_in_the_kernel(mode, natural):
    """``bwd_two_warpgroups.main(fused=True)``: the preprocess's rows in the prologue.  The
    kernel takes O, Lse, Sink and writes DSink, Delta and Lse2 (no longer const inputs); each
    thread's O row piece is loaded in 16-byte vectors before the query tile's wait (guarded by
    the real head count), multiplied with dO from shared memory after it, summed by a two-step
    butterfly, and lane 0 of each row writes the three values; one CTA barrier before the
    warpgroups split, none after; warpgroup 0 reads Lse2 / Delta from shared memory.  Lowers in
    both modes (the exact one is not launched yet), within the shared-memory cap."""
    art = _lower("bwd_main", main_args(64, mode == "exact", True, fused=True, natural=natural))
    src = art.kernel_source
    assert _smem(art) <= SMEM_LIMIT
    sig = _signature(src, "sparse_bwd_two_wg")
    for arg in ("const bfloat16_t* __restrict__ O", "const float* __restrict__ Lse",
                "const float* __restrict__ Sink", "float* __restrict__ DSink",
                "float* __restrict__ Delta", "float* __restrict__ Lse2", "int H,"):
        assert arg in sig, arg
    wait = src.index("q_ready[0].wait(")
    branch = src.index("if (((int)threadIdx.x) < 128)")
    o_loads = [m.start() for m in
               re.finditer(r"\*\(uint4\*\)\(o_r \+ [^;]*\*\(uint4\*\)\(O \+ ", src)]
    assert o_loads and all(i < wait for i in o_loads)
    assert src.rindex("< H)", 0, o_loads[0]) > src.rindex("cp_async", 0, o_loads[0])
    prologue = src[wait:branch]
    dO_loads = r"\*\(uint4\*\)\(do_r \+ 0\) = \*\(uint4\*\)\(\(\(bfloat16_t\*\)dO_[lr]\)"
    assert len(re.findall(dO_loads, prologue)) == 2
    for lane in (1, 2):
        assert f"__shfl_xor_sync((uint)4294967295, lse_r[2], {lane}, 32)" in prologue
    assert "% 4) == 0)" in prologue
    for out in ("Delta[", "Lse2[", "DSink["):
        assert prologue.count(out) == 2, out  # a real head's value, a pad head's 0
        assert out not in src[branch:]
    assert "__syncthreads();\n  if (((int)threadIdx.x) < 128)" in src
    assert "__syncthreads()" not in src[branch:]
    # rows_s is static shared memory: the dynamic pool's liveness merge never reuses it
    assert "__shared__ __align__(16) float rows_s[128];" in src
    assert "= rows_s[" in src[branch:]
    assert ("nearbyintf" in src) == (mode == "exact")


@pytest.mark.parametrize("has_sink, has_lse", [(True, True), (False, False)])
def test_value_stats_lowers_and_reads_what_it_checks(has_sink, has_lse):
    """The value checks' kernel lowers for sm_90a; it reads the lse (with a NaN test the
    simplifier keeps: ``x != x`` written in the DSL was folded to false, so the kernel uses
    ``T.isnan``) and the sink only when asked to."""
    src = _lower("value_stats", (has_sink, has_lse)).kernel_source
    assert ("Lse[" in src) == has_lse and ("Sink[" in src) == has_sink
    if has_lse:
        assert "x != x" in src or "isnan" in src  # CUDA's NaN test as TileLang writes T.isnan


def test_preprocess_keeps_a_nan_lse():
    """The backward preprocess passes a NaN lse on as NaN: its NaN test survives lowering (a
    ``lse != lse`` in the DSL was folded away, and max() drops a NaN, so a NaN lse became
    ``sink + 1``)."""
    src = _lower("bwd_pre", pre_args(True)).kernel_source
    # CUDA's NaN test as TileLang writes T.isnan: x != x (or isnan)
    assert re.search(r"(\bLse\[[^\]]*\]|\blse\w*) != (\bLse\[|\blse)", src) or "isnan" in src


def test_atomic_preprocess_has_no_fp64():
    """The atomic backward's preprocess writes Delta, Lse2 and DSink only (the deterministic
    backward's, ``grid_rows``, also squares dO in fp64 for the grids: not this one)."""
    plain = _lower("bwd_pre", pre_args(True)).kernel_source
    assert "DO2" not in plain and "double" not in plain
    for name in ("Delta[", "Lse2[", "DSink[", "tl::AllReduce<tl::SumOp, 16, 1, 0"):
        assert name in plain


@pytest.mark.parametrize("rows_per_warp", [8, 4, 2])
def test_red_pieces_microbenchmark_lowers(rows_per_warp, monkeypatch):
    """``tools/experiments/red_pieces.py`` (the L2's rate for 16-byte fp32 atomics by piece size
    per row) lowers for sm_90a: one ``AtomicAddx4`` per lane and piece, its columns
    ``4 (lane % (32 / G))`` within a piece of ``512 / G`` bytes, the rows guarded by ``R``."""
    import sys

    from paddlefleet.tilelang_ops import settings as st

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "tools/experiments"))
    sys.modules.pop("red_pieces", None)
    import red_pieces

    tilelang = st.import_tilelang()
    from tilelang import tvm

    jk = red_pieces.red_pieces
    with tvm.transform.PassContext(opt_level=3, config=jk.pass_configs), \
            tvm.target.Target(st.TARGET):
        src = tilelang.lower(jk.get_tir(rows_per_warp), target=st.TARGET).kernel_source
    lanes = 32 // rows_per_warp
    assert src.count("AtomicAddx4(") == 1
    assert f"for (int p = 0; p < {576 // (4 * lanes)}; ++p)" in src
    assert f"(int64_t){4 * lanes})" in src  # the piece's stride along the row
    assert "< R)" in src
