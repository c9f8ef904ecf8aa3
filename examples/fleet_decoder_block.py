"""A decoder block around MQALatentAttention, set up as in a PaddleFleet model (CPU, seconds).

    python examples/fleet_decoder_block.py                    # one process: mp_degree 1
    python -m paddle.distributed.launch --nproc_per_node 2 examples/fleet_decoder_block.py
                                                              # mp_degree 2 (gloo on CPU;
                                                              # rank 0's lines: log/workerlog.0)

A PaddleFleet-style config -> MQALatentAttentionConfig.from_fleet_config; fleet.init with
mp_degree = number of processes; RMSNorm -> attention (recomputed) -> residual -> RMSNorm -> MLP
-> residual; one AdamW step; a state_dict round trip.  Prints one ``check`` line per property.
"""

import os
import sys
import tempfile
from dataclasses import dataclass

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.distributed import fleet
from paddle.distributed.fleet.utils import recompute

from paddlefleet.tilelang_ops.attn.config import MQALatentAttentionConfig
from paddlefleet.tilelang_ops.attn.indices import causal_topk_indices
from paddlefleet.tilelang_ops.attn.layer import MQALatentAttention


@dataclass
class FleetConfig:
    """Stands in for PaddleFleet's TransformerConfig (same field names, small sizes)."""
    hidden_size: int = 256
    num_attention_heads: int = 16
    q_lora_rank: int = 96
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    dsa_index_topk: int = 32
    add_full_attention_sink_bias: bool = True      # the learned per-head sink
    mqa_sparse_attn_backward_backend: str = "tilelang"  # deterministic; PaddleFleet's default
                                                        # "cudnn" is refused, see fleet_config.py
    tensor_model_parallel_size: int = 1
    rms_norm_eps: float = 1e-6
    init_method_std: float = 0.02
    intermediate_size: int = 512


class RMSNorm(paddle.nn.Layer):  # Paddle 3.3.1: no nn.RMSNorm; F.rms_norm has no CPU kernel
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter(
            [size], default_initializer=paddle.nn.initializer.Constant(1.0))

    def forward(self, x):
        return x * paddle.rsqrt(x.square().mean(-1, keepdim=True) + self.eps) * self.weight


class DecoderBlock(paddle.nn.Layer):
    def __init__(self, cfg: FleetConfig, seed: int):
        super().__init__()
        # On CPU the TileLang backward cannot run (it needs a Hopper GPU and the DeepSeek shape,
        # Dk 576 / Dv 512): the fp32 reference backward stands in.  Drop the override on a GPU.
        attn_cfg = MQALatentAttentionConfig.from_fleet_config(cfg, backward_backend="reference")
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # group=None: the layer takes fleet's model-parallel group (hcg) by itself.
        self.attn = MQALatentAttention(attn_cfg, group=None, seed=seed)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Replicated MLP for brevity (a real model splits it over the mp group too).
        self.mlp = paddle.nn.Sequential(paddle.nn.Linear(cfg.hidden_size, cfg.intermediate_size),
                                        paddle.nn.GELU(),
                                        paddle.nn.Linear(cfg.intermediate_size, cfg.hidden_size))

    def forward(self, x, token_indices, use_recompute=True):
        h = self.norm1(x)
        # Recompute keeps only the block input; the backward reruns the attention forward, and
        # the top-k indices are an input, so the rerun attends to exactly the same keys.
        a = recompute(self.attn, h, token_indices) if use_recompute else self.attn(h, token_indices)
        x = x + a
        return x + self.mlp(self.norm2(x))


def main():
    world = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    cfg = FleetConfig(tensor_model_parallel_size=world)
    strategy = fleet.DistributedStrategy()
    # dp x mp on GPUs: dp_degree * mp_degree = world size; the layer talks to the mp group only.
    # On CPU (gloo, Paddle 3.3.1) only groups spanning the whole world work: dp_degree 1.
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": world, "pp_degree": 1,
                               "sharding_degree": 1}
    fleet.init(is_collective=True, strategy=strategy)
    rank = dist.get_rank()
    paddle.seed(0)  # the same replicated weights (norms, MLP) on every rank
    block = DecoderBlock(cfg, seed=0)
    print(f"rank {rank}: {block.attn.extra_repr()}, sm_scale={block.attn.config.sm_scale:.6f}")

    # token_indices: in a DSA model the lightning indexer (PaddleFleet's DSAIndexer) scores every
    # causal key of each query row and hands over its dsa_index_topk best; integer positions,
    # no gradient, the same on every mp rank.  A random causal stand-in here.
    B, S = 2, 64
    idx = paddle.to_tensor(causal_topk_indices(B, S, S, cfg.dsa_index_topk, seed=1))
    x = paddle.to_tensor(np.random.default_rng(2).standard_normal((B, S, cfg.hidden_size)),
                         dtype="float32")

    def grads(use_recompute):
        block.clear_gradients()
        loss = block(x, idx, use_recompute).square().mean()
        loss.backward()
        return loss, {n: p.grad.numpy().copy() for n, p in block.named_parameters()}

    loss, g_rc = grads(True)
    _, g_plain = grads(False)
    print("check loss_finite:", bool(np.isfinite(loss.item())))
    print("check recompute_grads_bitwise_equal:",
          all(np.array_equal(g_rc[n], g_plain[n]) for n in g_rc))

    opt = paddle.optimizer.AdamW(learning_rate=1e-3, parameters=block.parameters())
    before = block.attn.wq_b.numpy().copy()
    grads(True)
    opt.step()
    opt.clear_grad()
    print("check optimizer_step_changed_weights:",
          not np.array_equal(before, block.attn.wq_b.numpy()))

    # state_dict round trip: each mp rank saves and loads its own shard (its heads' weights).
    with paddle.no_grad():
        out = block(x, idx, use_recompute=False).numpy()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, f"block.mp{block.attn.tp_rank}.pdparams")
            paddle.save(block.state_dict(), path)
            fresh = DecoderBlock(cfg, seed=123)  # other weights until the load
            fresh.set_state_dict(paddle.load(path))
        again = fresh(x, idx, use_recompute=False).numpy()
    print("check reload_bitwise_equal:", bool(np.array_equal(out, again)))
    print(f"rank {rank}: loss {loss.item():.9e}, attention keys: {sorted(block.attn.state_dict())}")


if __name__ == "__main__":
    sys.exit(main())
