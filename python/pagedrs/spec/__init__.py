"""Speculative decoding: proposers guess the next tokens, one forward verifies them (core/spec_step.py)."""
