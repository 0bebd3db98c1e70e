"""Benchmarks that ship with peagle (``peagle bench``, ``peagle tune``; docs/benchmarks.md).

* ``timing``: CUDA-event timers (graph, eager per call, eager back to back), copy ceiling,
  the results JSON format.
* ``prepare_draft_inputs`` / ``verify_chain`` / ``paged_attention`` / ``write_kv_cache``: every op
  against its peer in the same run (``peagle bench ops <op>``; the short names ``prep``,
  ``verify``, ``attention``, ``kv`` still work and name the result files); ``multiop_prep`` is the
  vLLM-style multi-op peer of ``prepare_draft_inputs``; the random draft-step batches are in
  :mod:`peagle.testing`.
* ``e2e``: decode throughput of P-EAGLE / EAGLE-3 / no speculation with the default pair,
  ``projection`` the per-pass timing of a larger random-weight target, ``tune`` the best K and
  break-even tables, ``report`` / ``plots`` the docs tables and PNGs; ``released`` the released
  target shapes with synthetic acceptance (``acceptance_tables``: the rate tables) and
  ``released_report`` their docs/results.md sections (issue 20's goals, published numbers).

Importing this package imports nothing heavy; each module imports torch (and Triton, for the
multi-op peer) itself.
"""
