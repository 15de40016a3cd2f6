"""Standalone benchmarks of the engine (`python -m bench.<name>`); not part of the installed package."""
