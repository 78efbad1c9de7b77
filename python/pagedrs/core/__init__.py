"""The engine core: token ids in, token ids out; never a string (see core/engine_core.py)."""
