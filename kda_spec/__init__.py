"""The contract shared by the implementation (`kda_impl`), the dump writer (`dump_gen`) and the checker
(`conformance`): the layer's configuration and presets (`config`), its HF weight names and shapes
(`weight_names`), dump format v1 (`dump_format`), the layer's math in float64, the oracle both the
writer and the checker judge by (`truth`), and the two readers every side needs the same way:
one layer of a safetensors checkpoint (`checkpoint`) and a dump location, local or remote (`remote`).

numpy, ml_dtypes, safetensors and fsspec only. It imports none of the three packages that build on it.
"""
