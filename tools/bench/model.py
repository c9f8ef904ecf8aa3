"""The benchmark's shapes and its one work model: FLOPs, fewest HBM bytes, floors, the L2-side
gather/scatter traffic, and the per-rank shapes and all-to-all bytes of the two ways to split
the attention core over TP ranks.  Pure Python, so every environment can test it.

FLOPs count the GEMMs and every top-k slot, ``-1`` slots included (the kernels process them
masked), as the upstream TileLang example counts them, so rates compare one to one:

    fwd = 2*B*S*H*topk*(Dk + Dv)        Q K^T over Dk, P V over Dv
    bwd = 2*B*S*H*topk*(2*Dv + 3*Dk)    S recomputed (Dk), dP = dO V^T (Dv), dV = P^T dO (Dv),
                                        dQ = dS K (Dk), dK = dS^T Q (Dk)
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
    """``query [B, S, H, Dk]``, ``kv [B, S_kv, Dk]``, ``token_indices [B, S, topk]``."""

    name: str
    B: int
    S: int
    S_kv: int
    H: int
    topk: int
    Dk: int = 576
    Dv: int = 512

    def dims(self) -> str:
        return f"B={self.B} S={self.S} S_kv={self.S_kv} H={self.H} topk={self.topk}"


SHAPES = {s.name: s for s in (
    Shape("ref", 1, 4096, 8192, 64, 2048),    # the upstream example's (DeepSeek-V3.2, H=64)
    Shape("tp8", 1, 4096, 8192, 8, 2048),     # one TP=8 rank of ref's 64 heads
    Shape("tp4", 1, 4096, 8192, 16, 2048),    # one TP=4 rank
    Shape("h128", 1, 4096, 8192, 128, 2048),  # two head groups per row
    Shape("fleet", 1, 8192, 8192, 64, 640),   # PaddleFleet's docstring shape
    Shape("b2", 2, 2048, 8192, 64, 2048),     # ref's B*S and FLOPs in two sequences
    Shape("tiny", 1, 64, 128, 16, 32),        # CPU stand-in and tests only
)}
DEFAULT_SHAPES = ("ref", "tp8", "tp4", "h128", "fleet", "b2")


def select_shapes(spec: str | None, option: str = "--shapes") -> list[Shape]:
    """``None``/``""``/``"default"``: the defaults; ``"all"``: every shape; else comma-separated
    names (order kept, repeats dropped).  Raises ValueError naming ``option`` and the known names."""
    if spec is None or spec.strip() in ("", "default"):
        return [SHAPES[n] for n in DEFAULT_SHAPES]
    if spec.strip() == "all":
        return list(SHAPES.values())
    names = [n.strip() for n in spec.split(",") if n.strip()]
    for n in names:
        if n not in SHAPES:
            raise ValueError(f"{option}: unknown shape {n!r}; known: {', '.join(SHAPES)}")
    if not names:
        raise ValueError(f"{option}: no shape named in {spec!r}; known: {', '.join(SHAPES)}")
    return [SHAPES[n] for n in dict.fromkeys(names)]


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
