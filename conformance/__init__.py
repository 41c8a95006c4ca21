"""Numerical conformance of JAX KDA implementations against frozen torch dumps."""
