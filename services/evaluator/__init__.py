"""evaluator: scores each k-th version of every run on its environments' eval splits, on an engine of its own."""
