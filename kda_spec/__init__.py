"""The contract shared by the implementation (`kda_impl`), the dump writer (`dump_gen`) and the checker
(`conformance`): the layer's configuration and presets, its HF weight names and shapes, and dump format v1.

Pure Python and numpy. It imports none of the three packages that build on it.
"""
