"""A simulated OpenAI-compatible inference engine (vLLM-like) with runtime fault injection.

Modules: ``text`` (deterministic tokens), ``protocol`` (OpenAI request/response shapes),
``engine`` (slots, queue, prefix cache, counters), ``gpu`` (VRAM/KV/temperature maths),
``metrics`` (Prometheus page), ``faults`` (fault values and decisions), ``sink`` (response
writing) and ``server`` (HTTP handlers, ``SimOptions``, ``start_sim``, ``run_sim``).
"""
