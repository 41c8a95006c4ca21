"""fla's own forward KDA tests run on kda_impl's kernels: `python -m tests.fla_shim --fla PATH` (or
`make fla-tests FLA=PATH`), PATH an fla checkout (its tests/ops/test_kda.py is collected from there, never
copied here). `adapters` maps fla's torch functions onto kda_impl's, `plugin` patches the test module and
counts the outcomes. tests/test_fla_shim.py tests the machinery without a checkout."""
