"""Redis: tier queues are lists; Lua scripts make capacity, fetching, aging and recovery atomic.

The only code that knows Redis commands. ``transport`` (kombu's Redis transport with a capped
publish and owner-aware acks), ``publishing`` (the producer side), ``fetch`` (a worker's fetch
source), ``housekeeping`` (the jobs a worker runs for the fleet), ``admin`` (operators' view),
``continuations``, ``boost``, ``bulk``, ``liveness``, ``pruning``, and ``scripts`` (the Lua files).
"""
