"""Where a step compiles: trace, the compilers and their backends, the analysis, preflight."""
