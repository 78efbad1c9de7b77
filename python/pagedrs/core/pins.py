"""Pinned prefixes at the engine core (issue 27): ``LLM.pin_prefix`` / ``unpin``, with a TTL.

A pin keeps a prompt's pages (a system prompt's) on the device: no eviction takes them
while it lives, so every request that starts with the prompt hits them. The pages are
held by the Rust core as a hidden sequence (``Scheduler.pin_prefix``: invariant 2,
refcount = table entries, holds; the fit checks of ``add_sequence`` subtract them).

    pin(tokens) ──► internal request (max_tokens=1, first in line) ──► steps until it ends
                                                    │ its prompt's full pages committed, cached
                    Scheduler.pin_prefix(tokens) ◄──┘ only committed device pages are pinned:
                                                      never a hit on K/V not yet written

Pinning runs the prompt's prefill as an ordinary request, so other requests keep stepping
meanwhile: their outputs are handed back to the client (``PinOutcome.outputs``), which
returns them with its next step. Pins count against ``EngineArgs.max_pinned_fraction`` of
the device pool (``PinCapError`` past it) and expire at step boundaries on a monotonic
clock (``clock`` is injectable for tests). Everything here runs on the core's thread.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from pagedrs.core.protocol import CoreOutputItem, CoreRequest, CoreTokenRows, Pinned, PinPrefix, PinState
from pagedrs.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedrs.core.engine_core import EngineCore

MAX_TTL_S = 7 * 24 * 3600.0  # the longest TTL a pin may ask for: 7 days
PIN_PRIORITY = -(2**62)  # a pin's prefill goes before every request (lower runs first)
MAX_PIN_STEPS = 100_000  # a prefill that has not ended after this many steps is abandoned
_REQUEST_PREFIX = "\x00pin-"  # internal request ids: no front end can send a NUL in an id it validated


def validate_ttl(ttl_s: Any) -> Optional[float]:
    """``ttl_s`` as a float, or None (no TTL); ValueError naming it, its value and the range."""
    if ttl_s is None:
        return None
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not math.isfinite(ttl_s) or not (
        0 < ttl_s <= MAX_TTL_S
    ):
        raise ValueError(
            f"ttl_s={ttl_s!r} is out of range: allowed a finite number of seconds in (0, {MAX_TTL_S:g}] "
            "(7 days), or null for a pin that lives until it is unpinned"
        )
    return float(ttl_s)


def validate_fraction(value: Any) -> float:
    """``EngineArgs.max_pinned_fraction``: a number in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value <= 1):
        raise ValueError(f"max_pinned_fraction={value!r} is out of range: allowed a number in (0, 1]")
    return float(value)


@dataclass
class _Pin:
    core_id: int  # the Rust scheduler's pin id
    num_tokens: int
    num_pages: int
    ttl_s: Optional[float]
    expires_at: Optional[float]  # on the registry's clock


@dataclass
class PinOutcome:
    answer: Pinned
    outputs: list[CoreOutputItem] = field(default_factory=list)  # other requests' outputs of the steps the prefill ran


class PinRegistry:
    """The core's live pins, by id ("pin-N"); ``clock`` is the monotonic clock TTLs run on."""

    def __init__(self, core: EngineCore, max_pinned_fraction: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.core = core
        self.max_pinned_fraction = validate_fraction(max_pinned_fraction)
        self.clock = clock
        self._pins: dict[str, _Pin] = {}
        self._prefills = itertools.count(1)
        self.num_expired = 0

    def __len__(self) -> int:
        return len(self._pins)

    @property
    def cap_blocks(self) -> int:
        """Device pages all pins together may hold."""
        return int(self.max_pinned_fraction * self.core.scheduler.num_gpu_blocks)

    # ---- commands -------------------------------------------------------------------

    def pin(self, command: PinPrefix) -> PinOutcome:
        """Prefills the prompt (unless its pages are pinned already) and pins its full pages."""
        self.expire()
        args = self.core.args
        if args.kv_layout != "paged" or not args.enable_prefix_caching:
            return _refused("invalid", f"cannot pin a prefix with kv_layout={args.kv_layout!r}, enable_prefix_caching="
                                       f"{args.enable_prefix_caching}: pins need kv_layout='paged' and prefix caching on")
        scheduler, tokens = self.core.scheduler, command.token_ids
        block_size = scheduler.block_size
        salt = None if command.cache_salt is None else command.cache_salt.encode("utf-8")
        if len(tokens) < block_size:
            return _refused("invalid", f"the prompt has {len(tokens)} tokens; a pin holds whole pages, so it needs at "
                                       f"least block_size = {block_size} tokens")
        pool = scheduler.num_gpu_blocks
        if len(tokens) // block_size >= pool:  # its prefill (prompt + one token) could never run
            return _refused("invalid", f"the prompt has {len(tokens)} tokens, {len(tokens) // block_size} pages of "
                                       f"{block_size}; the device pool holds {pool} pages: it can never be pinned")
        array = np.asarray(tokens, dtype=np.uint32)
        new, pinned, cap = scheduler.num_new_pinned_blocks(array, cache_salt=salt), scheduler.num_pinned_blocks(), self.cap_blocks
        if pinned + new > cap:
            return _refused("cap", (
                f"the pin needs {new} more device pages; {pinned} are pinned and the cap is {cap} of "
                f"{scheduler.num_gpu_blocks} (max_pinned_fraction={self.max_pinned_fraction:g}); unpin a prefix or "
                "raise --max-pinned-fraction"))
        outputs: list[CoreOutputItem] = []
        if new > 0:
            try:
                outputs = self._prefill(tokens, command.cache_salt)
            except ValueError as exc:  # the prompt can never fit the pool (the scheduler's fit check)
                return _refused("invalid", str(exc))
        try:
            core_id, num_tokens, num_pages = scheduler.pin_prefix(array, cache_salt=salt)
        except ValueError as exc:
            return PinOutcome(Pinned(None, str(exc), "invalid"), outputs)
        now = self.clock()
        pin = _Pin(core_id, num_tokens, num_pages, command.ttl_s, None if command.ttl_s is None else now + command.ttl_s)
        pin_id = f"pin-{core_id}"
        self._pins[pin_id] = pin
        return PinOutcome(Pinned(self._state(pin_id, pin, now)), outputs)

    def unpin(self, pin_id: str) -> bool:
        """Releases a pin; False when it is not live."""
        self.expire()
        pin = self._pins.pop(pin_id, None)
        if pin is None:
            return False
        self.core.scheduler.unpin(pin.core_id)
        return True

    def states(self) -> list[PinState]:
        """The live pins, oldest first (expired ones released first)."""
        self.expire()
        now = self.clock()
        return [self._state(pin_id, pin, now) for pin_id, pin in self._pins.items()]

    def expire(self) -> int:
        """Releases every pin whose TTL ran out; how many. Called at every step boundary."""
        if not self._pins:
            return 0
        now = self.clock()
        gone = [pin_id for pin_id, pin in self._pins.items() if pin.expires_at is not None and pin.expires_at <= now]
        for pin_id in gone:
            self.core.scheduler.unpin(self._pins.pop(pin_id).core_id)
        self.num_expired += len(gone)
        return len(gone)

    def release_all(self) -> None:
        """Shutdown: every pin's pages go back (cached ones stay evictable)."""
        for pin in self._pins.values():
            self.core.scheduler.unpin(pin.core_id)
        self._pins.clear()

    # ---- the prefill ----------------------------------------------------------------

    def _prefill(self, tokens: list[int], cache_salt: Optional[str]) -> list[CoreOutputItem]:
        """Runs the prompt as an internal request of one greedy token, first in line, until it
        ends; returns the outputs the steps made for other requests (its own are dropped)."""
        request_id = f"{_REQUEST_PREFIX}{next(self._prefills)}"
        core = self.core
        core.add(CoreRequest(request_id, list(tokens), SamplingParams(max_tokens=1, temperature=0.0), PIN_PRIORITY,
                             None, cache_salt))
        others: list[CoreOutputItem] = []
        for _ in range(MAX_PIN_STEPS):
            if request_id not in core.requests:
                break
            # its one token ends it, so it is never a steady row (CoreTokenRows): only its CoreOutputs are dropped
            others.extend(out for out in core.step().outputs
                          if isinstance(out, CoreTokenRows) or out.request_id != request_id)
        else:
            core.abort(request_id)
            raise ValueError(f"the pin's prefill did not finish within {MAX_PIN_STEPS} steps; nothing was pinned")
        return others

    def _state(self, pin_id: str, pin: _Pin, now: float) -> PinState:
        left = None if pin.expires_at is None else max(0.0, pin.expires_at - now)
        return PinState(pin_id, pin.num_tokens, pin.num_pages, pin.ttl_s, left)


def _refused(kind: str, message: str) -> PinOutcome:
    return PinOutcome(Pinned(None, message, kind))
