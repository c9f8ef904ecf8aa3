"""How ``pytest -n N`` (pytest-xdist) shares the suite between its worker processes: one test
file stays in one worker (``--dist loadfile``: a file's module fixtures and the kernels it
lowers are built once), and the multi-rank tests (``tests/multi_card_tests/``) all run in one
worker, one after another, as without xdist: each starts up to 8 rank processes with timeouts
and signal timings, and two such launches at once on a 2-core machine would double their
load.  Without xdist this plugin does nothing (the hook is optional)."""

from __future__ import annotations

import pytest

#: every test under this folder is one scope (one worker, in collection order)
MULTI_RANK_DIR = "multi_card_tests/"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        """``--dist loadfile``, with every multi-rank test file in one scope."""

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return MULTI_RANK_DIR if MULTI_RANK_DIR in path else path

    if config.getoption("dist") != "loadfile":
        return None  # another --dist asked for explicitly: xdist's own scheduler
    return FileScheduling(config, log)
