"""The ``attn`` package as a user meets it: ``help()`` is a short index, names load lazily."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import REPO_ROOT

_HELP_IN_A_FRESH_PROCESS = """
import json, pydoc, sys
import paddlefleet.tilelang_ops.attn as attn
text = pydoc.render_doc(attn, renderer=pydoc.plaintext)
print(json.dumps({"text": text, "all": attn.__all__, "dir": dir(attn),
                  "heavy": sorted(m for m in ("paddle", "torch", "tilelang") if m in sys.modules)}))
"""


def _fresh_help() -> dict:
    res = subprocess.run([sys.executable, "-c", _HELP_IN_A_FRESH_PROCESS], capture_output=True,
                         text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT / "src")))
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_help_is_a_short_index_of_every_public_name():
    """It was ~1,900 lines: inherited paddle.nn.Layer docs and the lazy-loading hooks listed as
    functions."""
    got = _fresh_help()
    text, names = got["text"], got["all"]
    assert len(text.splitlines()) < 80, text
    description = text.split("DESCRIPTION", 1)[1].split("PACKAGE CONTENTS", 1)[0]
    missing = [n for n in names if n not in description]
    assert not missing, f"names missing from the package docstring's index: {missing}"
    for noise in ("__getattr__", "__dir__", "_LazyModule", "Methods inherited"):
        assert noise not in text, noise
    assert got["heavy"] == [], "help() must not import the frameworks"


def test_dir_lists_every_public_name_before_any_is_loaded():
    """Issue 42: ``dir()`` listed only this file's helpers (import_module, sys, types) until a
    name was used; tab completion and ``dir()`` now show the public names, loaded or not."""
    got = _fresh_help()
    listed = got["dir"]
    assert set(got["all"]) <= set(listed), sorted(set(got["all"]) - set(listed))
    assert "__all__" in listed and "__doc__" in listed
    for helper in ("import_module", "sys", "types", "_EXPORTS", "_LazyModule"):
        assert helper not in listed, helper
    assert listed == sorted(listed)


def test_names_load_on_first_use():
    from paddlefleet.tilelang_ops import attn
    from paddlefleet.tilelang_ops.attn import indices

    assert attn.causal_topk_indices is indices.causal_topk_indices
    assert "causal_topk_indices" in dir(attn)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        attn.no_such_name  # noqa: B018
    from paddlefleet.tilelang_ops.attn import load_config  # from-import goes through the hook

    assert load_config.__module__ == "paddlefleet.tilelang_ops.attn.config"


@pytest.mark.parametrize("module, name", [
    ("", "sparse_mqa_attention"), ("", "MLAAttentionConfig"), ("", "sparse_mqa_fwd_ref"),
    ("", "sparse_mqa_bwd_ref"), ("", "validate_inputs"), ("op", "sparse_mqa_attention"),
    ("op", "SparseMQAAttentionFunction"), ("config", "MLAAttentionConfig"),
    ("reference", "sparse_mqa_fwd_ref"), ("reference", "sparse_mqa_bwd_ref"),
    ("reference", "lse_natural_to_log2_sink"), ("reference", "lse_log2_sink_to_natural"),
    ("checks", "validate_inputs")])
def test_former_names_are_gone(module, name):
    """No release shipped the op family's former names: one name per object (issue 37)."""
    from importlib import import_module

    mod = import_module("paddlefleet.tilelang_ops.attn" + (f".{module}" if module else ""))
    assert not hasattr(mod, name)
