"""The checks: what is checked for a case, how the implementation is called for it, and the
float64 truth it is judged against."""
