"""The documentation's commands work from any checkout: no one machine's paths in them."""

from __future__ import annotations

import re

import pytest

from helpers import REPO_ROOT

DOCS = sorted([REPO_ROOT / "README.md", *(REPO_ROOT / "docs").glob("*.md"),
               *(REPO_ROOT / "tools").rglob("*.md")])
# A developer's checkout or virtualenvs (issue 12: docs/validation.md ran `cd /work/main` and
# `/work/venvs/paddle/bin/python`); /tmp scratch folders are fine anywhere.
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:work|home|Users|root)/[\w.-]+")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_no_machine_specific_paths(doc):
    hits = [f"{doc.name}:{n}: {line.strip()}"
            for n, line in enumerate(doc.read_text().splitlines(), 1) if MACHINE_PATH.search(line)]
    assert not hits, "\n".join(hits)


def test_validation_doc_runs_from_the_checkout_root():
    text = (REPO_ROOT / "docs" / "validation.md").read_text()
    how = text.split("## How to run", 1)[1].split("\n## ", 1)[0]
    assert "bash .ci/run" in how
    assert "python -m pytest -q tests/test_interface.py tests/test_kernel_compile.py" in how
