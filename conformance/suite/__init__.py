"""The conformance suite: a parametrized pytest suite, one test per case × dtype × check.

Run it through `python -m conformance run`, or directly:
`pytest conformance/suite --dumps golden [--impl …] [--kernel …] [-k T65]`.
"""
