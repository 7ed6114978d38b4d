"""Structured output: a per-request grammar that masks the tokens each step may emit.

``params.py`` is what a request asks for (a JSON schema, any JSON object, a regular
expression, an EBNF grammar, a choice among strings), validated before any compute;
``backend.py`` is the small interface a grammar library implements (``xgrammar_backend.py``
is the one shipped); ``compiler.py`` compiles constraints off the step loop and caches them;
``masks.py`` fills one step's masks for the whole batch. The sampler applies a mask after it
has measured the model's own entropy, so the control laws read the model, not the grammar.
"""
