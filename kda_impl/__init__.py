"""Kimi Delta Attention (KDA) for JAX serving: kernels, the Flax NNX layer, backend and state pool.

Importing the package is cheap; the submodules pull in JAX on first use.
"""

__version__ = "0.1.0"
