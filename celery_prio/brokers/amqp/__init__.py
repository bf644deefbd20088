"""RabbitMQ (AMQP 0-9-1 through py-amqp): capacity and aging are RabbitMQ's own queue arguments.

The only code that knows AMQP. ``topology`` (queues, exchanges, arguments), ``publishing`` (the
producer side), ``fetch`` and ``consume`` (a worker's fetch sources), ``admin`` (operators' view),
``registry`` (sub-queues and presence, on the broker), ``continuations``, ``boost``, ``bulk``,
``wire`` (pre-encoded publish frames) and ``management`` (the optional HTTP API).
"""
