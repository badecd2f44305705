"""Tokens: tokenizers, chat templates, incremental encoding and its fidelity probes,
detokenization, reading replies (reasoning, tool-call parsers, constraints)."""
