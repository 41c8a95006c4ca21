"""`python -m conformance search`: generated cases judged against the float64 truth (docs/search.md).

One job per module:

- `space.py`: the input space, a hypothesis strategy of `SearchCase`s, and a case's input arrays;
- `dumpcase.py`: a case as a format-v1 dump set, its reference the plain fp32 pipeline and its truth
  float64 (`kda_spec.truth`): what the judge reads and what a reproducer is;
- `judge.py`: one case's checks through `CheckRunner`, each against the truth, relative to the plain
  fp32 pipeline's own error;
- `explore.py`: hypothesis drives the generation and the shrinking within the time budget;
- `reproducer.py`: the shrunk case written as a dump set, replayed by the suite's own checks;
- `report.py`: the progress bar, the terminal table and `search.json`;
- `command.py`: the command, tying them together.
"""
