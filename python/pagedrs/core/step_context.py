"""StepContext: everything one engine-core step reads and produces (core/step.py runs it).

Separate from the step's phases so that the data they hand each other is defined in one
small place: the synchronous step (core/step.py), the asynchronous one (core/async_step.py)
and a speculative step's sampling rounds each build their own ``StepContext``, and two steps
in flight at once never share one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from pagedrs.core import prompt_logprobs, spec_step
from pagedrs.core.continuation import Decision
from pagedrs.core.protocol import CoreTokenRows
from pagedrs.core.request import Request, Sample
from pagedrs.core.structured.mask import StepMasks
from pagedrs.sampling import SampleResult
from pagedrs.step_input import StepInput

Rows = dict[str, tuple[Request, list[tuple[int, Sample]]]]  # request id -> (request, [(logits row, sample)])


@dataclass
class StepContext:
    """One step's working set, filled phase by phase."""

    start: float  # time.monotonic() when the step began
    step: Optional[StepInput] = None  # the plan, as the executor takes it
    logits: Optional[torch.Tensor] = None  # float32 [rows, vocab]
    rows: Rows = field(default_factory=dict)  # the sampling rows, by request
    draws: list[tuple[int, Request, Sample]] = field(default_factory=list)  # (logits row, request, sample) per draw
    results: list[Optional[SampleResult]] = field(default_factory=list)  # per draw; None: that request failed
    decisions: list[tuple[Request, Decision]] = field(default_factory=list)
    touched: dict[str, Request] = field(default_factory=dict)  # requests that progressed or ended: their outputs
    prompt_rows: list[prompt_logprobs.PromptRows] = field(default_factory=list)  # prompt_logprobs' rows
    spec: Optional[spec_step.SpecRows] = None  # speculating sequences' verify rows (core/spec_step.py)
    masks: Optional[StepMasks] = None  # grammar masks computed while the forward runs (synchronous steps)
    # the steady decode rows' outputs in columns (core/fast_rows.py, ``record``), before ``touched``'s
    steady: CoreTokenRows = field(default_factory=CoreTokenRows)
