"""Packaging for paddlefleet-tilelang-ops.

Runtime dependencies are the Paddle stack (paddlepaddle, the ``cpu`` extra, or paddlepaddle-gpu
installed beforehand on CUDA machines, and tilelang-paddle, Paddle's build of TileLang) plus
numpy, tqdm and psutil.  The PyTorch validation environment (mainline ``tilelang`` + ``torch``)
is described in docs/developing.md; it cannot share an environment with tilelang-paddle because
both install the top-level ``tilelang`` package.
"""

from setuptools import find_namespace_packages, setup

setup(
    name="paddlefleet-tilelang-ops",
    version="0.1.0",
    description="Deterministic TileLang sparse MQA-latent attention (DSA) kernels with an attention sink for Paddle training",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    package_dir={"": "src"},
    # `paddlefleet` is a namespace package so that we can live beside PaddleFleet itself.
    packages=find_namespace_packages(where="src", include=["paddlefleet.*"]),
    # Paddle itself is an extra: paddlepaddle (CPU) and paddlepaddle-gpu (CUDA, from Paddle's
    # own index) are two distributions of the same `paddle` package, and a requirement on
    # paddlepaddle would install the CPU build over a CUDA one.  README.md, "Installing on a
    # CUDA machine".
    install_requires=["numpy", "tqdm", "psutil", "tilelang-paddle>=0.1.13"],
    extras_require={
        "cpu": ["paddlepaddle>=3.3"],
        # pytest-xdist: .ci/run spreads the suite over the cores (pytest -n 2)
        "test": ["pytest", "pytest-xdist"],
    },
)
