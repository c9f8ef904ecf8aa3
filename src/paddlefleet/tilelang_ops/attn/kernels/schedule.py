"""The kernels' schedules: one frozen record per kernel, filled by one function that says why.

A schedule is what a kernel builder takes besides the problem (head tile, ``Dk``, ``Dv``, the
determinism decision, dQ on/off): tile sizes and the shape of its pipeline, static (one compile
each).  Each function below gives the shipped schedule and the reason for every field; the
measurements behind them are in ``docs/performance.md``.  The registry (``kernels/__init__.py``)
passes these records to the builders, and tools that try another schedule change a field by
name (``dataclasses.replace``).  No TileLang import: the registry and the host read these.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FwdSchedule", "fwd_schedule", "BwdSchedule", "bwd_schedule",
           "TwoWarpgroupSchedule", "two_warpgroup_schedule"]


@dataclass(frozen=True)
class FwdSchedule:
    """The forward's (``sparse_fwd.py``).

    block_k: key block ``BK`` (``L`` is a multiple of it).
    threads, num_stages: the one-role kernel's (16- and 32-head tiles) threads and
        ``T.Pipelined`` depth.
    consumer_regs: the 64-head warp-specialised kernel's ``setmaxnreg`` per consumer thread,
        a multiple of 8 in ``[168, 240]``; its producer gets ``504 - 2 consumer_regs``.
    """

    block_k: int
    threads: int
    num_stages: int
    consumer_regs: int


def fwd_schedule() -> FwdSchedule:
    """The shipped forward schedule (every head tile):

    * ``block_k = 64``: the 64-head kernel passes ``P`` through the rope tail's buffer, which
      needs ``BK = Dk - Dv = M`` (at ``Dk = Dv`` a buffer of its own, ``[M, BK]``); the one-role kernel's 8 warps need ``M / 16`` rows by
      ``BK / 8`` columns of the score GEMM, which 64 gives for 16 and 32 heads alike;
    * ``threads = 256``, ``num_stages = 1``: two warpgroups, and the next block's gather issued
      as soon as the last GEMM that reads the current one is (its shared memory holds one key
      block at a time);
    * ``consumer_regs = 224``: the consumers' softmax and two accumulators need them (at 208
      they spill); the producer's 56 hold its gathers without a spill, and 216 / 72 measured
      slower in most GPU states.
    """
    return FwdSchedule(block_k=64, threads=256, num_stages=1, consumer_regs=224)


@dataclass(frozen=True)
class BwdSchedule:
    """The one-role main backward's (``bwd_main.py``: 16- and 32-head tiles, and every
    re-run without dQ).

    block_k: key block ``BK`` (``tiling.bwd_key_block``; divides ``tiling.INDEX_PAD``).
    threads, num_stages: threads per CTA and ``T.Pipelined`` depth.
    dkv_chunk: ``CW``, the columns of dKV computed per chunk (a multiple of 4, ``>= Dk - Dv``).
    dkv_transposed: compute each dKV chunk as ``[CW, BK]`` (``Q_c^T dS + dO_c^T P``) and stage
        it back untransposed.
    """

    block_k: int
    threads: int
    num_stages: int
    dkv_chunk: int
    dkv_transposed: bool


def bwd_schedule(heads_per_cta: int) -> BwdSchedule:
    """The shipped one-role backward schedule for a head tile:

    * ``block_k``: ``tiling.bwd_key_block`` (64 for 16 heads so that the score GEMM gives each
      of the 8 warps whole 8-column slices, else 32 to keep the dKV fragment in registers);
    * ``threads = 256``, ``num_stages = 1``: the next block's gather is issued right after dQ's
      GEMMs (the last readers of the keys), so that it lands under the dKV chunks;
    * ``dkv_chunk = 128``: a ``[BK, 128]`` accumulator instead of ``[BK, Dk]`` keeps the
      registers under the cap (the whole row spilled in the deterministic mode);
    * ``dkv_transposed`` for 64-head tiles only: there the chunk's GEMM has ``M = CW`` rows
      instead of ``BK = 32``, enough for wgmma from shared memory instead of ``mma_sync`` whose
      warps each re-read ``dS^T`` / ``P^T``; with 16 or 32 heads the row-major form was faster.
    """
    from ..tiling import bwd_key_block

    return BwdSchedule(block_k=bwd_key_block(heads_per_cta), threads=256, num_stages=1,
                       dkv_chunk=128, dkv_transposed=heads_per_cta == 64)


@dataclass(frozen=True)
class TwoWarpgroupSchedule:
    """The 64-head first pass's (``bwd_two_warpgroups.py``).

    wg0_chunks: how many of each key block's dKV chunks (nine at (Dk, Dv) = (576, 512), eight
        at (512, 512)) the scores warpgroup (0) adds: the block's last ones, the rope tail first
        where there is one; 1 (the rope tail, or at 512 the right half's last) or 2 (also the
        right half's last, or at 512 its last two); warpgroup 1 adds the others.
    overlap: warpgroup 1 holds two accumulators and issues chunk ``c + 1``'s GEMMs before it
        adds chunk ``c``.
    row_lanes: lanes per key row of a 16-byte atomic, 4 (each lane its own float4s) or 8 (lanes
        ``t`` and ``t ^ 4`` trade half of theirs: 128-byte pieces).
    pred_red: each piece added by a predicated ``red`` (``ptx.RED_V4_SRC``) instead of an
        atomic behind a branch.
    """

    wg0_chunks: int
    overlap: bool
    row_lanes: int
    pred_red: bool

    def __post_init__(self):
        if self.wg0_chunks not in (1, 2) or self.row_lanes not in (4, 8):
            raise ValueError(f"wg0_chunks must be 1 or 2 and row_lanes 4 or 8, got {self}")


def two_warpgroup_schedule(deterministic: bool) -> TwoWarpgroupSchedule:
    """The shipped 64-head first-pass schedule, by the determinism decision:

    * atomic (``deterministic=False``): warpgroup 0 adds the rope tail (``wg0_chunks = 1``; at
      ``Dk = Dv``, with no tail, the right half's last chunk: unmeasured on a GPU), the
      dKV warpgroup overlaps its GEMMs with the atomics (``overlap``), eight lanes per key row
      (128-byte pieces reach the L2 faster than 64-byte ones) and predicated reds (the branch
      around each atomic ended a basic block, so ptxas could not hoist the next shuffles);
    * deterministic: each contribution is also rounded onto its key's grid and bounded, which
      makes warpgroup 1 the longer path: two chunks on warpgroup 0, one accumulator, four lanes
      per row and branches (the overlap, eight lanes and reds all measured slower here: with
      the rounding's registers ptxas spills).
    """
    if deterministic:
        return TwoWarpgroupSchedule(wg0_chunks=2, overlap=False, row_lanes=4, pred_red=False)
    return TwoWarpgroupSchedule(wg0_chunks=1, overlap=True, row_lanes=8, pred_red=True)
