"""Training modes: the Strategy registry (strategy.py), the one loop every mode runs in (loop.py), what a run is
given (context.py), what it records and reports (base.py), and the built-in strategies ps, allreduce, hybrid and
pipeline, which register themselves."""
