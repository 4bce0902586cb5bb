"""First-request latency of vLLM with a TurboQuant KV cache, with and without tq-warmup.

vLLM's TurboQuant attention backend runs Triton kernels that are not all compiled while
the engine starts, so the first requests that reach a new kernel path pay a JIT compile.
``python -m benchmarks.tqbench`` (from the repository root) measures that:

* ``run``: one configuration in this process (needs a GPU and vLLM);
* ``matrix``: one ``run`` subprocess per preset, mode, geometry and variant, plus the
  ``auto`` baseline; raw runs to ``benchmarks/results/raw/``, logs to ``.../logs/``;
* ``collect``: raw runs -> ``benchmarks/results/SUMMARY.md`` and ``summary.json``;
* ``spec``: speculative decoding with a TurboQuant cache: tokens against an eager
  reference, and throughput, one child per configuration;
* ``shipped``: serving from a Triton cache built elsewhere, mounted read-only;
* ``register-cost``: what the plugin's ``register()`` costs a process;
* ``layer-check-cost``: what the shipped cache's startup check costs a process.

Modules, one job each: ``phases`` (what is requested), ``phase_runner`` (timing the
phases), ``engine`` (engine keywords, GPU name, repository root), ``children`` (child
processes: process groups, time limits, deadline), ``recorder`` (Triton compiles,
profiler), ``records`` (raw run files), ``logs`` (log parsing), ``tables`` (text
tables), ``summary`` (summary rows), ``spec_configs`` / ``spec_child`` / ``verdicts`` /
``spec_tables`` (the spec benchmark's configurations, child, comparison and tables),
and one module per command. The plugin has to be
installed with its entry point (``pip install --no-deps .``) for vLLM to load it;
``plugin_entry_point_found`` in each record says whether it could.
"""
