"""A conformance adapter for sglang-jax's KDA (see README.md)."""
