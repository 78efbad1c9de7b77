"""The torch generator seed for a request's 64-bit seed on a device (``generator_seed``).

Its own module because the reason is a property of torch's generators, not of the core: CUDA's keeps
64 bits and the CPU's 32, and the mixing below is what keeps seeds 2**32 apart from sharing a stream.
"""

from __future__ import annotations

import torch


def generator_seed(seed: int, device: torch.device) -> int:
    """The torch generator seed for a request's 64-bit ``seed`` on ``device``.

    CUDA's Philox generator keeps all 64 bits. The CPU's Mersenne Twister keeps the low 32 only
    (``manual_seed(2**32)`` draws what ``manual_seed(0)`` does), so seeds 2**32 apart would share
    one stream: a request seeded 2**32 would repeat seed 0's samples. On the CPU a seed of 2**32
    or more is mixed down to 32 bits (splitmix64's finalizer, then the halves folded), so every bit
    counts; seeds below 2**32 are used as they are (their streams are unchanged). Two seeds may still
    share a stream, as any two of a 32-bit space do: with probability 2**-32 a pair, not by structure.
    """
    if device.type != "cpu" or seed < 2**32:
        return seed
    z = (seed + 0x9E3779B97F4A7C15) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    z ^= z >> 31
    return (z ^ (z >> 32)) & 0xFFFFFFFF
