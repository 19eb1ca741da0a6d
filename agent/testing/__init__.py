"""Fixtures: tiny random checkpoints for tests, benchmarks and `migrator demo --arch`."""
