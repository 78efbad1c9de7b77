"""The padded decode path and its CUDA graphs (the runner's layer: ``ModelRunner`` uses them).

    padding.py  capture sizes, ``DecodePadding``, ``StaticDecodeInputs``: a decode step padded to a
                fixed shape in preallocated buffers, its padding rows on the scratch page
    capture.py  ``DecodeGraphs``: one CUDA graph per capture size, checked against the eager forward
"""

from pagedrs.decode_graphs.capture import DecodeGraphs, graph_headroom_bytes
from pagedrs.decode_graphs.padding import (
    MAX_CAPTURE_SIZE,
    DecodePadding,
    PaddedStep,
    StaticDecodeInputs,
    capture_sizes,
    padded_size,
)

__all__ = ["MAX_CAPTURE_SIZE", "DecodeGraphs", "DecodePadding", "PaddedStep", "StaticDecodeInputs", "capture_sizes",
           "graph_headroom_bytes", "padded_size"]
