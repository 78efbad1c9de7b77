"""The engine core's process: what runs on the far side of MPClient's pipe (frontend/mp_client.py).

Separate from the client because the two halves never run in one process: ``core_main`` is
the spawned child's entry (it travels to the child by name, so the child imports this module,
not the client), builds the ``EngineCore``, applies the API process's commands between steps
and sends back its outputs, stats and answers; MPClient, in the API process, only talks to it.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from pagedrs.core.prefix_cache import answer_reset
from pagedrs.core.protocol import (
    Abort,
    Add,
    CoreOutputs,
    CoreTokenRows,
    FinishSample,
    ListPins,
    PinList,
    PinPrefix,
    ResetPrefixCache,
    Unpin,
    Unpinned,
)
from pagedrs.engine_args import EngineArgs
from pagedrs.errors import FieldError
from pagedrs.frontend import codec
from pagedrs.frontend.codec import Added, AddRefused, CoreFailed, Ready, StepOutputs, Stop
from pagedrs.frontend.core_pipe import SerialSender, beat

logger = logging.getLogger("pagedrs.server")


def core_main(conn: Connection, args: EngineArgs, heartbeat_s: float = 1.0) -> None:
    """The core process: build the core, then apply commands and step until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process drains, then sends Stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pipe = SerialSender(conn)
    from pagedrs.core.engine_core import EngineCore

    try:
        core = EngineCore(args)
    except BaseException as exc:  # noqa: BLE001 - report why the core cannot start
        pipe.send_bytes(codec.encode(CoreFailed(f"{type(exc).__name__}: {exc}")))
        return
    # What exists now (torch, the model, the tokenizer: ~200k objects) lives as long as the
    # process: out of the cyclic collector's reach, a full collection no longer walks it (vLLM
    # does the same). Measured at batch 256 in-process: the worst step of 60 went from 148 ms
    # (a full collection) to 19 ms; the median did not move.
    gc.collect()
    gc.freeze()
    tok = core.loaded.tokenizer
    pipe.send_bytes(codec.encode(Ready(
        pid=os.getpid(), tokenizer_folder=None if tok.hf is None else str(tok.hf.name_or_path),
        eos_token_ids=sorted(tok.eos_token_ids), vocab_size=core.loaded.config.vocab_size,
        max_model_len=int(core.max_model_len), model_name=core.loaded.name, stats=core.stats(),
    )))
    threading.Thread(target=beat, args=(pipe, heartbeat_s), name="pagedrs-core-heartbeat", daemon=True).start()
    timed: set[str] = set()  # requests whose metrics went out (with their first token)
    # Time in core.step() over the wall time of loop turns that had work: the share of a
    # saturated core that goes to scheduling + the model + sampling rather than to I/O.
    step_seconds = busy_seconds = 0.0
    try:
        while True:
            turn_start = time.perf_counter()
            busy = had_work = core.has_unfinished()
            # Commands first: an abort sent while the last step ran frees its pages before the next.
            while pipe.poll(0 if busy else 0.5):
                command = codec.decode(pipe.recv_bytes())
                if isinstance(command, Add):
                    request_id = command.request.request_id
                    try:
                        core.add(command.request)
                        pipe.send_bytes(codec.encode(Added(request_id)))
                    except Exception as exc:  # noqa: BLE001 - the client's error, reported back
                        message = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
                        param = exc.param if isinstance(exc, FieldError) else None
                        pipe.send_bytes(codec.encode(AddRefused(request_id, message, param)))
                    busy = True
                elif isinstance(command, Abort):  # its end goes back at once, with the stats it changed
                    if (aborted := core.abort(command.request_id)) is not None:
                        sent = CoreOutputs([aborted], core.stats())
                        _metrics_once(sent, timed)
                        pipe.send_bytes(codec.encode(StepOutputs(sent, step_seconds, busy_seconds)))
                    busy = core.has_unfinished()
                elif isinstance(command, FinishSample):
                    core.finish_sample(command.request_id, command.index, command.reason, command.stop_reason)
                    if command.request_id not in core.requests:  # it ended: the stats it changed go back now
                        sent = CoreOutputs([], core.stats())
                        pipe.send_bytes(codec.encode(StepOutputs(sent, step_seconds, busy_seconds)))
                    busy = core.has_unfinished()
                elif isinstance(command, ResetPrefixCache):  # between steps, as every command
                    pipe.send_bytes(codec.encode(answer_reset(core)))
                elif isinstance(command, (PinPrefix, Unpin, ListPins)):  # the stats they changed go first
                    pin_outputs, answer = _pin_command(core, command)
                    sent = CoreOutputs(pin_outputs, core.stats())
                    _metrics_once(sent, timed)
                    pipe.send_bytes(codec.encode(StepOutputs(sent, step_seconds, busy_seconds)))
                    pipe.send_bytes(codec.encode(answer))
                    busy = core.has_unfinished()
                elif isinstance(command, Stop):
                    core.shutdown()
                    return
            if core.pins.expire():  # a TTL ran out while idle: the freed pages show in the stats now
                pipe.send_bytes(codec.encode(StepOutputs(CoreOutputs([], core.stats()), step_seconds, busy_seconds)))
            if not core.has_unfinished():
                continue
            t0 = time.perf_counter()
            outputs = core.step()
            if had_work:
                step_seconds += time.perf_counter() - t0
            _metrics_once(outputs, timed)
            outputs.stats = core.stats()
            # this turn counts too, so far: the step just added to step_seconds is inside it
            busy_now = busy_seconds + (time.perf_counter() - turn_start if had_work else 0.0)
            pipe.send_bytes(codec.encode(StepOutputs(outputs, step_seconds, busy_now)))
            if had_work:  # a turn that began idle includes the wait for its first command
                busy_seconds += time.perf_counter() - turn_start
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the API process is gone: so is the core
    except BaseException as exc:  # noqa: BLE001
        logger.exception("engine core failed")
        try:
            pipe.send_bytes(codec.encode(CoreFailed(f"{type(exc).__name__}: {exc}")))
        except OSError:
            pass


def _pin_command(core: Any, command: Any) -> tuple[list[Any], Any]:
    """Applies a pin command in the core process: (outputs of the steps it ran, its answer)."""
    if isinstance(command, PinPrefix):
        outcome = core.pins.pin(command)
        return outcome.outputs, outcome.answer
    if isinstance(command, Unpin):
        return [], Unpinned(command.pin_id, core.pins.unpin(command.pin_id))
    return [], PinList(core.pins.states())


def _metrics_once(outputs: CoreOutputs, timed: set[str]) -> None:
    """Metrics cross once, with a request's first token (``timed``: the requests whose did)."""
    for out in outputs.outputs:
        if isinstance(out, CoreTokenRows):  # steady rows carry no metrics
            continue
        if out.request_id in timed or out.metrics is None or out.metrics.first_token_time is None:
            out.metrics = None
        else:
            timed.add(out.request_id)
        if out.finished:
            timed.discard(out.request_id)
