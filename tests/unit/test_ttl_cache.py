"""The API's TTL cache (registry.api.state.TTLCache over cachetools): fresh
hits, single-flight loads, stale entries through a database outage, bounded size."""

from __future__ import annotations

import threading
import time

import pytest

from registry.api.state import TTLCache


class Down(Exception):
    pass


def test_fresh_then_expired() -> None:
    c: TTLCache[str, int] = TTLCache(0.2)
    c.put("a", 1)
    assert c.peek("a") == (True, 1)
    time.sleep(0.25)
    assert c.peek("a") == (False, None)


def test_one_load_for_many_threads() -> None:
    c: TTLCache[str, int] = TTLCache(30.0)
    calls = []

    def load() -> int:
        calls.append(1)
        time.sleep(0.2)
        return 7

    got: list[int] = []
    threads = [threading.Thread(target=lambda: got.append(c.get_or_load("k", load)))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [7] * 8 and len(calls) == 1


def test_stale_entry_served_while_the_database_is_down_then_not() -> None:
    c: TTLCache[str, int] = TTLCache(0.1, stale_s=0.5, stale_on=(Down,))
    c.put("k", 1)
    time.sleep(0.15)

    def down() -> int:
        raise Down("database down")

    assert c.get_or_load("k", down) == 1  # expired 0.05 s ago: within stale_s
    time.sleep(0.6)
    with pytest.raises(Down):
        c.get_or_load("k", down)


def test_size_is_bounded_and_invalidate_drops_what_it_names() -> None:
    c: TTLCache[tuple[str, int], int] = TTLCache(30.0, max_entries=3)
    for i in range(5):
        c.put(("m", i), i)
    assert sum(c.has(("m", i)) for i in range(5)) == 3
    c.put(("n", 0), 0)
    c.invalidate(lambda key: key[0] == "m")
    assert c.has(("n", 0)) and not any(c.has(("m", i)) for i in range(5))


def test_stale_while_revalidate_serves_the_old_answer_to_others() -> None:
    c: TTLCache[str, str] = TTLCache(0.2)
    c.put("q", "old")
    time.sleep(0.25)
    assert c.lookup("q") == (None, True)  # this caller refreshes
    assert c.lookup("q") == ("old", False)  # the others get the old answer meanwhile
    c.refreshed("q", "new")
    assert c.lookup("q") == ("new", False)
