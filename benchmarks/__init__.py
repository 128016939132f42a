"""What the bridge costs a Dask scheduler and its workers: run each script from the
repository root as ``python -m benchmarks.<name>`` (benchmarks/README.md)."""
