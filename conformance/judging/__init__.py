"""How a result is judged: the measurements, the limits they are held to, the criteria and the one
verdict engine, the long cases' windows."""
