"""Per-team output filtering: the policy each surface applies (stored samples, served
completions, dataset exports) and the log of what the filter found. The detector itself is
the pure engine in ``workers.filtering``; see docs/filtering.md."""
