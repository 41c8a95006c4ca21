"""The torch dump generator: freezes what a PyTorch reference of the KDA layer computes.

`python -m dump_gen --out DIR_OR_URL ...` writes a dump set in format v1 (docs/dump-format.md): the weights,
one npz file per case with inputs, fp32 and bf16 results and the layer's intermediates, and a manifest
written last. Needs the torch extras (torch, transformers, fla-core); the conformance side reads the dump
with numpy alone.
"""
