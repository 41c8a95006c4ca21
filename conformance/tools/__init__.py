"""The commands built on the checks: the CI gate, the stage-by-stage diff, the power measurement."""
