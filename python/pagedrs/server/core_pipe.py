"""Moved to ``pagedrs.frontend.core_pipe``; these names stay importable from here."""

from pagedrs.frontend.core_pipe import (  # noqa: F401
    BEAT,
    INBOX_MESSAGES,
    REAP_TIMEOUT_S,
    Link,
    SerialSender,
    beat,
    describe_exit,
    drain_until_done,
    heartbeat_interval,
    receive_loop,
    send_loop,
    stop_core,
)
