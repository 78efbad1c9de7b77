"""Tensor parallelism: the process group, the step broadcast and the multi-process executor."""
