"""The benchmark's shapes and its one work model: FLOPs, fewest HBM bytes, floors, the L2-side
gather/scatter traffic, and the per-rank shapes and all-to-all bytes of the two ways to split
the attention core over TP ranks.  Pure Python, so every environment can test it.

FLOPs count the GEMMs and every top-k slot, ``-1`` slots included (the kernels process them
masked), as the upstream TileLang example counts them, so rates compare one to one:

    fwd = 2*B*S*H*topk*(Dk + Dv)        Q K^T over Dk, P V over Dv
    bwd = 2*B*S*H*topk*(2*Dv + 3*Dk)    S recomputed (Dk), dP = dO V^T (Dv), dV = P^T dO (Dv),
                                        dQ = dS K (Dk), dK = dS^T Q (Dk)

with each shape's own ``(Dk, Dv)``: DeepSeek-V3.2's (576, 512) (the value is the first 512
columns of the kv row) or DeepSeek-V4's (512, 512) (the value is the whole row; the ``v4*``
shapes, whose keys are V4's sliding window plus compressed tokens,
``attn.indices.window_compressed_indices``).
"""

from __future__ import annotations

import dataclasses
import math

#: Planning ceilings measured on our H200: dense bf16 8192^3 matmul, device-to-device copy.
#: A benchmark run measures both again and uses its own numbers.
H200_MATMUL_TFLOPS = 790.0
H200_COPY_TBS = 4.3


@dataclasses.dataclass(frozen=True)
class Shape:
    """``query [B, S, H, Dk]``, ``kv [B, S_kv, Dk]``, ``token_indices [B, S, topk]``.

    ``ratio`` None: random causal top-k keys (``attn.indices.causal_topk_indices``; the queries
    are the last S of S_kv positions).  ``ratio`` set: DeepSeek-V4's layout
    (``attn.indices.window_compressed_indices``): ``T`` tokens and ``kv = [T tokens | T // ratio
    compressed]``, so ``S_kv = T + T // ratio``; each row holds its ``window`` latest tokens and
    ``topk - window`` compressed keys picked among the complete groups it sees; the queries are
    the last S of the T tokens (S = T but in a sequence split's rank shape).

    Raises:
        ValueError: ``window`` without ``ratio`` or the reverse, ``ratio < 2``, ``topk <= window``,
            or no token count ``T >= S`` with ``T + T // ratio = S_kv``.
    """

    name: str
    B: int
    S: int
    S_kv: int
    H: int
    topk: int
    Dk: int = 576
    Dv: int = 512
    window: int | None = None
    ratio: int | None = None

    def __post_init__(self):
        if (self.window is None) != (self.ratio is None):
            raise ValueError(f"shape {self.name}: window and ratio go together (a V4 layout) or "
                             f"not at all, got window={self.window}, ratio={self.ratio}")
        if self.ratio is None:
            return
        if self.ratio < 2 or not 1 <= self.window < self.topk:
            raise ValueError(f"shape {self.name}: expected ratio >= 2 and 1 <= window < topk, "
                             f"got ratio={self.ratio}, window={self.window}, topk={self.topk}")
        self.tokens()  # raises where S_kv is no T + T // ratio

    def tokens(self) -> int:
        """``T`` of a V4 layout: the token count with ``T + T // ratio = S_kv`` (``T >= S``)."""
        r = self.ratio
        for t in range(self.S_kv * r // (r + 1) - 1, self.S_kv * r // (r + 1) + 2):
            if t >= self.S and t + t // r == self.S_kv:
                return t
        raise ValueError(f"shape {self.name}: S_kv={self.S_kv} is no T + T // {r} with T >= "
                         f"S={self.S} (kv = [T tokens | T // ratio compressed])")

    @property
    def compressed_topk(self) -> int | None:
        """Compressed slots per row of a V4 layout (``topk - window``), None otherwise."""
        return None if self.ratio is None else self.topk - self.window

    def dims(self) -> str:
        text = f"B={self.B} S={self.S} S_kv={self.S_kv} H={self.H} topk={self.topk}"
        if (self.Dk, self.Dv) != (576, 512):
            text += f" Dk={self.Dk} Dv={self.Dv}"
        if self.ratio is not None:
            text += f" ({self.window} window + {self.compressed_topk} of ratio {self.ratio})"
        return text


SHAPES = {s.name: s for s in (
    Shape("ref", 1, 4096, 8192, 64, 2048),    # the upstream example's (DeepSeek-V3.2, H=64)
    Shape("tp8", 1, 4096, 8192, 8, 2048),     # one TP=8 rank of ref's 64 heads
    Shape("tp4", 1, 4096, 8192, 16, 2048),    # one TP=4 rank
    Shape("h128", 1, 4096, 8192, 128, 2048),  # two head groups per row
    Shape("fleet", 1, 8192, 8192, 64, 640),   # PaddleFleet's docstring shape
    Shape("b2", 2, 2048, 8192, 64, 2048),     # ref's B*S and FLOPs in two sequences
    Shape("tiny", 1, 64, 128, 16, 32),        # CPU stand-in and tests only
    # DeepSeek-V4's ratio-4 compressed sparse attention at 4K tokens, (Dk, Dv) = (512, 512):
    # S_kv = S + S/4, top-k = a 128-token window + the indexer's compressed picks, sink on
    Shape("v4flash", 1, 4096, 5120, 64, 640, 512, 512, window=128, ratio=4),  # 128 + 512
    Shape("v4pro", 1, 4096, 5120, 128, 1152, 512, 512, window=128, ratio=4),  # 128 + 1024
    Shape("v4tp8", 1, 4096, 5120, 8, 640, 512, 512, window=128, ratio=4),     # a TP=8 rank
    Shape("v4tiny", 1, 128, 160, 16, 32, 512, 512, window=16, ratio=4),       # CPU stand-in
)}
DEFAULT_SHAPES = ("ref", "tp8", "tp4", "h128", "fleet", "b2")
#: DeepSeek-V4's shapes, (Dk, Dv) = (512, 512): ``--shapes v4`` (the GPU suite: ``default,v4``).
V4_SHAPES = ("v4flash", "v4pro", "v4tp8")
#: Names that stand for several shapes in ``--shapes``.
SHAPE_GROUPS = {"default": DEFAULT_SHAPES, "v4": V4_SHAPES, "all": tuple(SHAPES)}


def select_shapes(spec: str | None, option: str = "--shapes") -> list[Shape]:
    """``None``/``""``: the defaults; else comma-separated shape names or groups
    (:data:`SHAPE_GROUPS`: ``default``, ``v4``, ``all``), order kept, repeats dropped, e.g.
    ``"default,v4"``.  Raises ValueError naming ``option`` and the known names."""
    if spec is None or not spec.strip():
        return [SHAPES[n] for n in DEFAULT_SHAPES]
    names = [n.strip() for n in spec.split(",") if n.strip()]
    known = ", ".join(list(SHAPES) + [f"{g} (group)" for g in SHAPE_GROUPS])
    for n in names:
        if n not in SHAPES and n not in SHAPE_GROUPS:
            raise ValueError(f"{option}: unknown shape {n!r}; known: {known}")
    if not names:
        raise ValueError(f"{option}: no shape named in {spec!r}; known: {known}")
    flat = [m for n in names for m in SHAPE_GROUPS.get(n, (n,))]
    return [SHAPES[n] for n in dict.fromkeys(flat)]


def unbuilt_dims(s: Shape, built) -> str | None:
    """Why our kernels cannot run ``s``, or None: its ``(Dk, Dv)`` is not among ``built``
    (``attn.tiling.kernel_dims()``, i.e. ``kernels.D_PAIRS``)."""
    pair = (s.Dk, s.Dv)
    if pair in {tuple(p) for p in built}:
        return None
    return (f"kernels for {pair} not built (kernels.D_PAIRS lists "
            f"{', '.join(str(tuple(p)) for p in built)})")


def work(s: Shape, pass_: str) -> tuple[int, int]:
    """(FLOPs, fewest HBM bytes) of one ``"fwd"`` or ``"bwd"`` call.

    Bytes: the forward reads q, kv, indices (int32) and writes out (bf16) and lse (fp32); the
    backward reads q, kv, indices, out, dO, lse and writes dq and dkv (bf16).  The per-row kv
    gathers are left out: kv is 9.4 MB at S_kv = 8192 and stays in the L2 (see
    :func:`gather_scatter_bytes` for that traffic)."""
    slots = s.B * s.S * s.H * s.topk
    q, kv, idx = s.B * s.S * s.H * s.Dk * 2, s.B * s.S_kv * s.Dk * 2, s.B * s.S * s.topk * 4
    out, lse = s.B * s.S * s.H * s.Dv * 2, s.B * s.S * s.H * 4
    if pass_ == "fwd":
        return 2 * slots * (s.Dk + s.Dv), q + kv + idx + out + lse
    if pass_ == "bwd":
        return 2 * slots * (2 * s.Dv + 3 * s.Dk), 2 * q + 2 * kv + idx + 2 * out + lse
    raise ValueError(f"pass_: expected 'fwd' or 'bwd', got {pass_!r}")


def floor(flops: float, nbytes: float, peak_tflops: float = H200_MATMUL_TFLOPS,
          bw_tbs: float = H200_COPY_TBS) -> dict:
    """Compute and memory time in ms at the given ceilings; the larger is the floor."""
    compute_ms, memory_ms = flops / peak_tflops / 1e9, nbytes / bw_tbs / 1e9
    return {"compute_ms": compute_ms, "memory_ms": memory_ms,
            "floor_ms": max(compute_ms, memory_ms),
            "bound": "compute" if compute_ms >= memory_ms else "memory"}


def gather_scatter_bytes(s: Shape, block_h: int = 64) -> tuple[int, int]:
    """(bf16 kv bytes gathered, fp32 dKV bytes scattered) per backward: every CTA (one per query
    row and group of up to ``block_h`` heads) gathers its row's ``topk x Dk`` kv rows and adds
    as many dKV partials, whatever H is."""
    rows = s.B * s.S * math.ceil(s.H / block_h) * s.topk
    return rows * s.Dk * 2, rows * s.Dk * 4


#: TP degrees of the partition mode, and the two ways to split the attention core.
PARTITION_TPS = (1, 2, 4, 8)
PARTITIONS = ("heads", "seq")


def partition_shapes(base: Shape, tps=PARTITION_TPS) -> list[tuple[int, str, Shape]]:
    """``(tp, partition, rank shape)`` for each TP degree and partition.

    ``heads``: each rank runs H/tp heads over all S query rows.  ``seq`` (sequence): each rank
    runs all H heads over ceil(S/tp) rows; with S not divisible by tp the largest rank is the
    one the step waits for.  S_kv and topk stay (MQA: every rank needs the whole latent kv and
    adds a partial dkv, summed across ranks in both layouts).  At tp = 1 both are ``base``."""
    out = []
    for tp in tps:
        if base.H % tp:
            raise ValueError(f"partition: H={base.H} of {base.name} is not divisible by TP={tp}")
        for part in PARTITIONS:
            if tp == 1:
                out.append((tp, part, base))
            elif part == "heads":
                out.append((tp, part, dataclasses.replace(
                    base, name=f"{base.name}-heads-tp{tp}", H=base.H // tp)))
            else:
                out.append((tp, part, dataclasses.replace(
                    base, name=f"{base.name}-seq-tp{tp}", S=-(-base.S // tp))))
    return out


def seq_a2a_bytes(base: Shape, tp: int) -> float:
    """Bytes one rank sends per layer (forward + backward) to run the core in the ``seq``
    partition while the rest of the layer keeps heads split.

    Forward: the rank's query ``[B, S, H/tp, Dk]`` goes out (it keeps 1/tp of it) and the core
    output ``[B, ceil(S/tp), H, Dv]`` comes back the same way; backward: dO (the output's shape)
    out, dq (the query's) back.  All bf16:

        2 * (tp - 1) / tp * 2 * (B*S*(H/tp)*Dk + B*ceil(S/tp)*H*Dv)
    """
    q = base.B * base.S * (base.H // tp) * base.Dk * 2
    o = base.B * -(-base.S // tp) * base.H * base.Dv * 2
    return 2 * (tp - 1) / tp * (q + o)
