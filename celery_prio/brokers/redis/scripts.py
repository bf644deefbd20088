"""The Lua scripts that make capacity, fetching, aging and dead-lettering atomic on Redis.

Each script is a file in ``lua/`` (shipped as package data), its KEYS/ARGV
contract in its header comment, read once when this module is imported and
registered by the code that runs it (``client.register_script``: EVALSHA,
loaded on first use). Two directives are expanded at load: a line
``--#include <name>`` is replaced by ``lua/<name>.lua`` (shared functions),
and ``${NAME}`` by the constant of that name below, so the bounds live in
one place and Python code can read them.

Tier lists follow kombu: LPUSH adds on the left, consumers RPOP the oldest on
the right. A dead-letter entry is a JSON envelope around the untouched
original element (whatever it was), so that requeueing gives Celery back
exactly what it sent and a malformed element is kept as evidence.

A Redis script is not rolled back when a command fails half-way: every
script writes the copy before it removes the original, so an error can
duplicate an entry into the dead list but never lose one.
"""

from __future__ import annotations

import re
from importlib.resources import files

from ...headers import PROMOTED_SUFFIX, READY_INDEX

#: Bytes of messages one script call reads at most where it walks a list (requeue, boost scan, the
#: fetch's dead-lettering): a few ms of Redis, and little Lua memory, whatever the messages' size.
SCRIPT_BYTES = 4 * 1024 * 1024
#: Oldest elements one publish evicts at most under ``drop_oldest``: after a cap is lowered, the
#: excess goes over the following publishes (bounded each) instead of in one call.
EVICT_BUDGET = 1000
#: Most malformed elements one fetch call moves aside before it answers (and at most
#: ``SCRIPT_BYTES`` of them), so a list full of garbage never holds Redis for long.
FETCH_DEAD_BUDGET = 100
#: Elements one boost look reads at most, so Redis is never held long: about
#: 25 ms on this project's 2-core box (a boost looks again until done).
BOOST_SCAN_BUDGET = 10_000
#: Tokens a tier's doorbell holds at most (``lua/ring.lua``): how many idle workers one burst wakes.
BELL_MAX = 16

#: Seconds a sub-queue's list found empty stays in the ready index (``lua/mark_ready.lua``: ``leave_index``).
READY_LINGER = 1.0

_CONSTANTS = {
    "BELL_MAX": BELL_MAX,
    "SCRIPT_BYTES": SCRIPT_BYTES,
    "EVICT_BUDGET": EVICT_BUDGET,
    "FETCH_DEAD_BUDGET": FETCH_DEAD_BUDGET,
    "BOOST_SCAN_BUDGET": BOOST_SCAN_BUDGET,
    "PROMOTED_SUFFIX": PROMOTED_SUFFIX,
    "READY_LINGER": READY_LINGER,
    "READY_INDEX": READY_INDEX,
}
_INCLUDE = re.compile(r"^--#include (\w+)$", re.M)
_CONSTANT = re.compile(r"\$\{(\w+)\}")


def load(name: str) -> str:
    """The text of ``lua/<name>.lua`` with its includes and constants expanded."""
    text = files(__package__).joinpath("lua", f"{name}.lua").read_text()
    text = _INCLUDE.sub(lambda m: load(m.group(1)), text)
    return _CONSTANT.sub(lambda m: str(_CONSTANTS[m.group(1)]), text)


GUARDED_PUSH = load("guarded_push")
BULK_PUSH = load("bulk_push")
FETCH = load("fetch")
DEAD_LETTER = load("dead_letter")
DEAD_HEAD = load("dead_head")
DEAD_REQUEUE = load("dead_requeue")
TRIM_DEAD = load("trim_dead")
PROMOTE = load("promote")
STAMP = load("stamp")
BOOST_FIND = load("boost_find")
BOOST_MOVE = load("boost_move")
BOOST_HELD = load("boost_held")
HEARTBEAT = load("heartbeat")
SWEEP_DEAD_OWNERS = load("sweep_dead_owners")
HEAL_READY = load("heal_ready")
#: One list joins the ready index (a push made outside a script: the transport's pipelines and kombu's restore).
MARK_READY = load("mark_ready") + "mark_ready(KEYS[1], KEYS[2])\n"
