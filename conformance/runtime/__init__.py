"""Where the checker runs: the host's platform and accelerator, JAX's compile cache and CPU flags."""
