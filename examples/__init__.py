"""Worked examples of adapters for third-party KDA implementations (not installed with the package)."""
