"""fla's own KDA tests, their forward and backward checks, run on kda_impl's kernels: `python -m
tests.fla_shim --fla PATH` (or `make fla-tests FLA=PATH`), PATH an fla checkout (its tests/ops/test_kda.py
is collected from there, never copied here). `adapters` maps fla's torch functions onto kda_impl's (their
backward by `jax.vjp`), `plugin` patches the test module and counts the outcomes and the forward and
backward checks. tests/test_fla_shim.py tests the machinery without a checkout."""
