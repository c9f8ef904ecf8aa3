"""paddlefleet.tilelang_ops: TileLang fused operators for Paddle training stacks.

Sub-modules:
    attn      sparse MQA-latent attention (DeepSeek-V3.2 DSA) forward and a deterministic backward.
    settings  the single compile baseline shared by every kernel.
"""

__version__ = "0.1.0"
