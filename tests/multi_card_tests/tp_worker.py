"""Rank process of the tensor-parallel tests (launched by paddle.distributed.launch).

Usage: tp_worker.py OUT_DIR CASE [CASE ...]
Writes OUT_DIR/<case>_rank<r>.npz per case; the pytest process does the comparing, so a
mismatch is reported there with names and errors instead of a crashed rank.
"""

import os
import sys

import numpy as np
import paddle.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tp_case import run_case  # noqa: E402


def main():
    out_dir, cases = sys.argv[1], sys.argv[2:]
    dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    for name in cases:
        # group=None: the world group, which is the tensor-parallel group here (gloo sub-groups
        # are broken on the CPU wheel; Paddle 3.3.1).
        result = run_case(name, world)
        np.savez(os.path.join(out_dir, f"{name}_rank{rank}.npz"), **result)
    dist.barrier()


if __name__ == "__main__":
    main()
