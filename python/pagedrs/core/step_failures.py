"""What a step that failed leaves behind: the core forgets its writes, recomputes or ends its requests.

Separate from core/step.py's happy path (plan -> execute -> sample -> decide -> carry out)
because both the synchronous step and the asynchronous one (core/async_step.py) clean up
after a failed forward pass, and after disk writes that failed once queued, the same way.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pagedrs.core.request import Request
from pagedrs.kv_tiers.errors import CorruptPageError
from pagedrs.step_input import StepInput

if TYPE_CHECKING:
    from pagedrs.core.engine_core import EngineCore

logger = logging.getLogger("pagedrs.engine")


def on_failed_step(core: EngineCore, step: StepInput, exc: BaseException, touched: dict[str, Request]) -> None:
    """Nothing a failed step wrote is ever served: the core forgets it on every tier
    and resets the step's sequences (and any whose pages it left unwritten) to be
    recomputed. A lost disk page (a checksum failure) is the tier's fault, not the
    request's: its slots leave the disk index and the sequences are simply recomputed.
    Any other failure ends the requests that were in the step."""
    scheduler = core.scheduler
    scheduler.complete_transfers(core.executor.take_completed_transfers())
    lost_pages = isinstance(exc, CorruptPageError)
    if lost_pages:
        assert isinstance(exc, CorruptPageError)
        dropped = scheduler.invalidate_disk_slots(exc.slots)
        logger.warning("a step read %d disk page(s) that failed their checksum (%d dropped from the tier); "
                       "recomputing its %d sequences: %s", len(exc.slots), dropped, step.num_seqs, exc)
    reset = scheduler.complete_step(step.step_id, False)
    core.note_reset(reset)
    drop_failed_disk_writes(core)
    if lost_pages:
        return
    logger.error("the forward pass failed; ending the %d requests in it", step.num_seqs, exc_info=exc)
    for seq_id in step.seq_ids.tolist():
        entry = core.sequence(seq_id)
        if entry is not None:
            core.fail(entry[0], exc, touched)
    if len(reset) > step.num_seqs:
        logger.warning("the failed step also lost pages of %d paused sequences; they are recomputed",
                       len(reset) - step.num_seqs)


def drop_failed_disk_writes(core: EngineCore) -> None:
    """Disk writes that failed after they were queued (a full disk): their slots leave
    the core's index, so the pages are lost, never read back wrong."""
    failed = core.executor.take_failed_disk_slots()
    if failed:
        core.scheduler.invalidate_disk_slots(failed)
