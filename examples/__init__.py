"""Examples of dptrain user code (importable as `examples.*` when the repository is on PYTHONPATH)."""
