"""Moved to ``pagedrs.frontend.input_processor``; these names stay importable from here."""

from pagedrs.frontend.input_processor import InputProcessor, ProcessedRequest, PromptType

__all__ = ["InputProcessor", "ProcessedRequest", "PromptType"]
