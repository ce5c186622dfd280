"""Dataset profiling: the first real job a worker pool runs."""
