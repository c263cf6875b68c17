"""farm.build.uid_slots: each lease a uid no other running build has, freed
with its lease (or its process), and one fixed uid when the slots are off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from farm.build import uid_slots
from farm.core.settings import get_settings

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="only a root worker leases uids")


def test_leases_are_distinct_and_freed_with_their_lease() -> None:
    base = 61000  # apart from the farm's default range, which other tests lease
    a = uid_slots.take(base=base, count=2, wait_s=0)
    b = uid_slots.take(base=base, count=2, wait_s=0)
    try:
        assert {a.uid, b.uid} == {base, base + 1}
        with pytest.raises(uid_slots.NoFreeUid, match="FARM_SANDBOX_UIDS"):
            uid_slots.take(base=base, count=2, wait_s=0)
        a.release()
        c = uid_slots.take(base=base, count=2, wait_s=0)
        assert c.uid == a.uid
        c.release()
    finally:
        a.release()
        b.release()


def test_a_lease_held_by_another_process_is_not_given_out() -> None:
    code = (
        "import sys, time; from farm.build import uid_slots; "
        "l = uid_slots.take(base=61010, count=1, wait_s=0); print(l.uid, flush=True); "
        "sys.stdin.read()"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "61010"
        with pytest.raises(uid_slots.NoFreeUid):
            uid_slots.take(base=61010, count=1, wait_s=0)
    finally:
        p.communicate("")
    uid_slots.take(base=61010, count=1, wait_s=0).release()  # its exit freed it


def test_no_slots_means_the_one_sandbox_uid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FARM_SANDBOX_UIDS", "0")
    get_settings.cache_clear()
    try:
        assert uid_slots.take().uid == get_settings().farm_sandbox_uid
    finally:
        get_settings.cache_clear()
