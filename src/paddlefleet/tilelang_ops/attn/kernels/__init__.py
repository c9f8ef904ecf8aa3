"""TileLang kernels (no framework import): ``sparse_fwd`` (forward) and ``sparse_bwd``
(preprocess -> main -> postprocess of the backward).  Host wrappers: ``attn/interface.py``."""
