"""The server's limits and access settings, in one value that the CLI fills and the app reads.

Each limit bounds one resource a client could otherwise exhaust; docs/limits_and_safety.md
lists them with their defaults and what a client gets past them.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
DEFAULT_READ_TIMEOUT_S = 30.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0
DEFAULT_TOKENIZER_THREADS = 1
# A text prompt longer than max_model_len x this many characters cannot fit whatever it
# tokenizes to, unless one token covers more characters: the factor used is the larger of
# this and 4 x the longest vocabulary entry (see PromptTokenizer.max_chars).
MIN_CHARS_PER_TOKEN_BOUND = 64


@dataclass(frozen=True)
class ServerOptions:
    api_key: str | None = None  # when set, /v1/* (and /metrics) need `Authorization: Bearer <key>`
    metrics_public: bool = False  # /metrics without the key
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # request bodies beyond get 413
    # A connection has this long to send a complete request head (from opening, or from the end
    # of its previous response), and a request this long to send its whole body; then 408 / close.
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S  # drain deadline after SIGTERM / SIGINT
    tokenizer_threads: int = DEFAULT_TOKENIZER_THREADS  # worker threads that tokenize prompts

    def __post_init__(self) -> None:
        checks = [
            ("max_request_bytes", self.max_request_bytes, self.max_request_bytes >= 1024, ">= 1024"),
            ("read_timeout_s", self.read_timeout_s, self.read_timeout_s > 0, "> 0"),
            ("shutdown_timeout_s", self.shutdown_timeout_s, self.shutdown_timeout_s >= 0, ">= 0"),
            ("tokenizer_threads", self.tokenizer_threads, self.tokenizer_threads >= 1, ">= 1"),
        ]
        for name, value, ok, allowed in checks:
            if not ok:
                raise ValueError(f"ServerOptions.{name}={value!r} is out of range: allowed {allowed}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("ServerOptions.api_key is empty: pass a non-empty key, or None for no authentication")
