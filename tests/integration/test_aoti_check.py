"""The real check on this host: a tiny weight-free AOTI package is built in one
child process, then loaded, run and compared with eager in another.

The check runs once per test session: tests/conftest.py gives the session a
cache file of its own (``FARM_AOTI_CHECK_CACHE``, a new directory), and the
first process that needs the answer (a farm's compile worker, a test's build,
or this test) runs the whole check under the machine lock while the others
wait for it. This test asks for that answer and reads what was stored; it
does not run the check a second time with a cache of its own (40 CPU-s, the
most expensive single step a test session repeated).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from farm.build import aoti_check, toolchain

pytestmark = pytest.mark.integration


@pytest.mark.usefixtures("undo_compiler_choice")  # the answer chooses this process's compiler
def test_aoti_packages_built_here_load_here() -> None:
    cache = Path(os.environ["FARM_AOTI_CHECK_CACHE"])
    # A directory this session made: the answer below was checked in this session.
    assert cache.parent.name.startswith("farm-test-machine-"), cache
    assert aoti_check.aoti_loads_here("cpu") == (True, "ok")
    assert json.loads(cache.read_text()), "the check stored no answer"
    # The chosen compiler's package links the shared libstdc++ (what the check
    # is for: a static copy crashed at load on the H200 image).
    choice = toolchain.choose_compiler("cpu")
    assert choice.cxx and choice.linkage["links_shared_libstdcxx"] is True, choice
