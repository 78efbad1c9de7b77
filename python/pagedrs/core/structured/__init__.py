"""Structured outputs in the core: grammars (llguidance) that constrain what a sample may generate.

``grammar``: a ``StructuredOutputsParams`` as llguidance grammar text, checked (the front end's
check too). ``backend``: the compiler, one per tokenizer, with an LRU of compiled grammars.
``state``: one sample's matcher (``GrammarState``). ``mask``: a step's masks, applied to its logits.
"""
