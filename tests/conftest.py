"""Test configuration: the shared helpers and fixtures live in ``tests/helpers.py`` (a plugin
here, so its fixtures and hooks reach every test; test files import its helpers directly).

``TILELANG_CACHE_DIR`` defaults to ``<repo>/.tilelang-cache`` (git-ignored) so that tests never
write to the home directory; set before any test module can import TileLang.
"""

import os
from pathlib import Path

os.environ.setdefault("TILELANG_CACHE_DIR",
                      str(Path(__file__).resolve().parent.parent / ".tilelang-cache"))

# xdist_scopes: how `pytest -n 2` (.ci/run) shares the files between its workers
pytest_plugins = ["helpers", "xdist_scopes"]
