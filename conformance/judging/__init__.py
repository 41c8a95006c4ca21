"""How a result is judged: the measurements, the policy (tolerances.toml), the criteria and the one
verdict engine, the long cases' windows."""
