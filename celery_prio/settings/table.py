"""Every ``prio_*`` setting: its name, default, group and meaning, in one table.

The defaults ``load_settings`` starts from, the settings reference in the
docs (``docs/reference/settings.md``, generated from this table by
``celery_prio.ops.settings_reference``) and the list of valid names in error
messages all come from here. The valid values of each choice setting are
defined here once too.
"""

from __future__ import annotations

from typing import NamedTuple

OVERFLOW_POLICIES = ("reject", "drop_oldest")
QUEUE_TYPES = ("classic", "quorum")  # RabbitMQ's; Celery's task_default_queue_type takes the same two
SCHEDULER_MODES = ("time", "count")
IDLE_SHARE_RULES = ("proportional", "next_below")
FETCH_MODES = ("get", "consume")
#: Workers beat every second: a worker is taken for gone only after missing a few beats.
MIN_REDELIVER_AFTER = 2.0
#: Default slice length as a fraction of ``prio_realtime_target``. A realtime arrival on a busy
#: one-slot worker waits for the rest of the running slice plus the element in progress, so with
#: elements up to half the target, half the target for the slice keeps the total inside it.
SLICE_FRACTION = 0.5


class Setting(NamedTuple):
    name: str  # without the prio_ prefix
    default: object
    group: str
    doc: str  # Markdown, one line: what the reference page says
    shown: str | None = None  # how the reference shows the default, where its repr says too little


#: Default deadline of a realtime call, in multiples of ``prio_realtime_target``: a call that waited this long
#: is past the point where its caller still waits for it.
DEADLINE_FACTOR = 5.0


#: Default realtime wait budget as a fraction of ``prio_realtime_target``. An admitted call's latency is its wait
#: plus its own run and the dispatch around it; during a surge admission keeps the queue at the budget, so every
#: admitted call waits about that long: half the target for the wait leaves the other half for the rest.
WAIT_BUDGET_FRACTION = 0.5


def derived_max_wait(realtime_target: float) -> dict[str, float | None]:
    """The wait budgets ``prio_max_wait`` defaults to: half realtime's target; batch and offline admit by cap."""
    return {"realtime": realtime_target * WAIT_BUDGET_FRACTION, "batch": None, "offline": None}


def derived_slices(realtime_target: float) -> dict[str, float | None]:
    """The slice lengths ``prio_slice`` defaults to: realtime never yields, batch and offline after a fraction."""
    return {"realtime": None, "batch": realtime_target * SLICE_FRACTION, "offline": realtime_target * SLICE_FRACTION}


TIERS_AND_ROUTING = "Tiers and routing"
SCHEDULING = "Scheduling"
CAPACITY = "Capacity"
AGING = "Aging"
SLICES = "GPU time slices"
SUBQUEUES = "Sub-queues and shortest job first"
INHERITANCE = "Priority inheritance and boost"
BOOKKEEPING = "Dead letters and bookkeeping"
RECOVERY = "Recovery (Redis)"
RABBITMQ = "RabbitMQ"
OBSERVABILITY = "Observability"

SETTINGS: tuple[Setting, ...] = (
    Setting("weights", {"realtime": 8, "batch": 2, "offline": 1}, SCHEDULING, "shares of slot time; > 0"),
    Setting(
        "reserve",
        None,
        SCHEDULING,
        "slots only realtime may use; < concurrency",
        shown="None (1 if concurrency ≥ 2, else 0)",
    ),
    Setting("min_share", 5, SCHEDULING, "offline floor, per cent of slot time (dispatches per 100 in count mode)"),
    Setting(
        "aging",
        {"realtime": None, "batch": 1800, "offline": 1800},
        AGING,
        "seconds of waiting before promotion one tier up; `None` = never",
    ),
    Setting(
        "realtime_target",
        0.2,
        SCHEDULING,
        "seconds: the realtime P99 the defaults are made for (default slice lengths are half of it)",
    ),
    Setting(
        "slice",
        None,
        SLICES,
        "seconds a `celery_prio.slices()` run holds its slot before it yields to a waiting higher tier; `None`: "
        "half of `prio_realtime_target` for batch and offline (0.1 s); a dict overrides per tier; realtime must "
        "be `None`",
    ),
    Setting("subqueue_weights", {}, SUBQUEUES, "per tier, sub-queue name → weight inside the tier (default 1)"),
    Setting(
        "subqueue_key",
        None,
        SUBQUEUES,
        'callable `(task_name, args, kwargs, options)` → sub-queue name or `None`, or `"module:function"` naming one',
    ),
    Setting(
        "subqueue_max_length",
        {"realtime": None, "batch": None, "offline": None},
        SUBQUEUES,
        "cap of each sub-queue of a tier; `None` = the tier's `prio_max_length`",
    ),
    Setting(
        "inherit",
        True,
        INHERITANCE,
        "chain/chord steps run at least at the tier of the work waiting on them; children of a running task that "
        "name no tier run at its tier",
    ),
    Setting(
        "boost_timeout",
        1.0,
        INHERITANCE,
        "RabbitMQ: seconds a boost waits for every live worker to answer before it gives up (`refused`)",
    ),
    Setting(
        "boost_memory",
        10_000,
        INHERITANCE,
        "RabbitMQ: how many recently published batch/offline tasks a process remembers (what it can boost); 0 = none",
    ),
    Setting(
        "boost_key",
        None,
        INHERITANCE,
        "RabbitMQ: the key boost journal records, `prio_supersede` broadcasts and answers are signed with "
        "(≥ 16 characters); `None`: derived from the broker URL's user, password and vhost and `prio_queue_prefix`, "
        "or, where the password is empty or `guest`, none (boosts on RabbitMQ are then refused)",
    ),
    Setting(
        "boost_memory_bytes",
        64 * 1024 * 1024,
        INHERITANCE,
        "RabbitMQ: ... and at most this many bytes of their arguments (weighed by sampling; oldest forgotten "
        "first, a bigger message not kept)",
    ),
    Setting(
        "dead_letter_max",
        100_000,
        BOOKKEEPING,
        "dead letters kept at most; the oldest beyond it are dropped and counted (`celery_prio_dead_dropped_total`, "
        "Redis; RabbitMQ: the queue's `x-max-length`); `None` = no cap",
    ),
    Setting(
        "prune_after",
        7 * 86400,
        BOOKKEEPING,
        "Redis: seconds after which a worker, estimate or idle sub-queue nobody mentioned is pruned from the "
        "fleet's hashes (≥ 60)",
    ),
    Setting(
        "demand_target",
        {"realtime": 0.2, "batch": 300, "offline": 3600},
        OBSERVABILITY,
        "the demand signal: seconds in which each tier's waiting work should drain",
    ),
    Setting(
        "trace_file",
        None,
        OBSERVABILITY,
        "a file each worker appends what it ran to (one JSON line per task: tier, queue, task name, "
        "enqueue/start/end), for `prio simulate`",
    ),
    Setting(
        "redeliver_after",
        {"realtime": 5, "batch": 10, "offline": 10},
        RECOVERY,
        "Redis: seconds after its worker's last heartbeat (sent every second from a thread of its own) that a "
        "message it fetched goes back to its queue (≥ 2)",
    ),
    Setting(
        "wait_replicas",
        0,
        RECOVERY,
        "Redis: a publish to a capped tier queue (and each bulk chunk) returns once this many replicas have it "
        "(`WAIT`, 1 s); with Sentinel, 1 loses no accepted task at a failover",
    ),
    Setting(
        "queue_type",
        None,
        RABBITMQ,
        'RabbitMQ: `"classic"` or `"quorum"` (replicated) tier, front-lane, sub-queue and dead-letter queues; '
        "`None`: Celery's `task_default_queue_type` (`classic`). Redis ignores it",
    ),
    Setting(
        "fetch",
        None,
        RABBITMQ,
        'RabbitMQ: how a worker fetches its queues. `"consume"`: pushed to consumers of prefetch 1 (tier queues, '
        "front lanes, sub-queues); per queue in hand no more than the worker is expected to start within "
        "half of `prio_hold_max` at its recent pace (realtime: its free slots; one at least; Celery's prefetch "
        "at most), each for at most "
        '`prio_hold_max`; classic queues only. `"get"`: one `basic_get` per task, nothing held that '
        "another worker could run, a round trip per fetch and per empty queue asked. Redis ignores it",
        shown='None ("consume" on classic queues, "get" on quorum queues)',
    ),
    Setting(
        "hold_max",
        0.1,
        RABBITMQ,
        'RabbitMQ with `prio_fetch = "consume"`: seconds a pushed message may wait for a slot before it goes back '
        "to its queue",
    ),
    Setting("trace_max", 100_000, OBSERVABILITY, "lines a worker writes to `prio_trace_file` at most"),
    Setting("sjf", True, SUBQUEUES, "realtime: one sub-queue per task name, shortest expected run first"),
    Setting(
        "sjf_max_wait",
        1.0,
        SUBQUEUES,
        "seconds after which a realtime queue not looked at goes first (the bound on what SJF adds to a long "
        "task's wait)",
    ),
    Setting(
        "max_length",
        {"realtime": 1000, "batch": 100_000, "offline": 1_000_000},
        CAPACITY,
        "cap per tier; `None` = no cap",
    ),
    Setting(
        "max_wait",
        None,
        CAPACITY,
        "seconds a call may be predicted to wait before it runs (the work ahead of it in its tier, by the "
        "fleet's run-time estimates, over the slots serving the tier); a publish over it is refused with "
        "`QueueFull` (429). `None`: half of `prio_realtime_target` for realtime (0.1 s: the rest of the target is "
        "the call's own run), no budget for batch and offline; a dict overrides per tier (`None`: no budget). "
        "Redis and RabbitMQ; see [Capacity](../guides/capacity.md)",
        shown="None (realtime: prio_realtime_target / 2; batch, offline: none)",
    ),
    Setting(
        "realtime_deadline",
        None,
        CAPACITY,
        "seconds after its publish a realtime call is no longer run: it is marked expired (its `.get()` raises "
        "`TaskRevokedError` at once) and counted; `0`: never. A call's own `expires=` wins",
        shown="None (5 x prio_realtime_target: 1 s)",
    ),
    Setting(
        "overflow",
        {"realtime": "reject", "batch": "reject", "offline": "drop_oldest"},
        CAPACITY,
        "`reject` or `drop_oldest`",
    ),
    Setting("queue_prefix", "prio", TIERS_AND_ROUTING, "queues are `<prefix>.realtime`, `.batch`, `.offline`, `.dead`"),
    Setting("default_tier", "batch", TIERS_AND_ROUTING, "tier of tasks that name none"),
    Setting("routes", {}, TIERS_AND_ROUTING, "task-name pattern (fnmatch) → tier"),
    Setting(
        "legacy_queues",
        None,
        TIERS_AND_ROUTING,
        "queues that producers not yet on celery-prio still publish to: workers that serve the default tier "
        "also drain each one, as that tier, for as long as it holds messages (a rolling deploy); `[]` = none",
        shown="None (the app's `task_default_queue` before `install()`: `celery` unless it set one)",
    ),
    Setting("scheduler", "time", SCHEDULING, "`time` (shares of slot time) or `count` (for comparison)"),
    Setting(
        "idle_share",
        "proportional",
        SCHEDULING,
        "an idle tier's weight: unused, the busy tiers keep their ratio (`proportional`), or given to the next "
        "busy tier below (`next_below`)",
    ),
    Setting(
        "poll_interval",
        0.05,
        SCHEDULING,
        'where an idle worker cannot block on the broker (RabbitMQ quorum queues, `prio_fetch = "consume"`\'s '
        "sub-queues): the longest pause between fetch attempts while every tier is empty",
    ),
    Setting(
        "gpus",
        None,
        SCHEDULING,
        'GPUs for each worker\'s pool processes, e.g. `"0,1"`: one per process, round robin, pinned before CUDA '
        "starts (the worker's `--prio-gpus` option and `CELERY_PRIO_GPUS` say the same per worker; "
        "[Workers on GPUs](../guides/gpus.md))",
    ),
    Setting("aging_interval", 1.0, AGING, "seconds between aging passes (Redis)"),
    Setting("metrics_port", None, OBSERVABILITY, "serve Prometheus `/metrics` from each worker on this port"),
    Setting("metrics_host", "127.0.0.1", OBSERVABILITY, "address for `/metrics` (`0.0.0.0` in containers)"),
    Setting(
        "management_url",
        None,
        RABBITMQ,
        "optional RabbitMQ management API, for `Retry-After` figures and listing idle sub-queues (default: the "
        "broker host, HTTPS on 15671 for TLS brokers; a cluster: several URLs, `;`-separated, or every failover "
        "host); sub-queue discovery does not need it. Each URL's own credentials, else the broker's; masked in "
        "`celery inspect conf`",
    ),
    Setting(
        "management_plain_http",
        False,
        RABBITMQ,
        "send the broker's credentials to a management endpoint over plain HTTP off this host (by default they "
        "are withheld, with an error logged, and the API goes unused)",
    ),
)

#: Name -> default, in the table's order.
DEFAULTS: dict[str, object] = {s.name: s.default for s in SETTINGS}
SETTING_NAMES = tuple(DEFAULTS)
#: The groups in the order the reference shows them.
GROUPS = (
    TIERS_AND_ROUTING,
    SCHEDULING,
    CAPACITY,
    AGING,
    SLICES,
    SUBQUEUES,
    INHERITANCE,
    BOOKKEEPING,
    RECOVERY,
    RABBITMQ,
    OBSERVABILITY,
)
