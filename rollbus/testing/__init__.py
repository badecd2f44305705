"""Test doubles that speak the real protocols: scripted SGLang and vLLM engine servers
(:mod:`rollbus.testing.scripted`, :mod:`rollbus.testing.scripted_vllm`), an engine in process
answered by a handler function (:mod:`rollbus.testing.engine`), and the event log in memory with
an edge service built on it (:mod:`rollbus.testing.memory_log`). Nothing in the production packages
imports them; the tests, the benchmarks and ``python -m rollbus.testing`` (a scripted engine on a
port, for trying the stack by hand) do.
"""
