"""Scenario C and verification: baseline, run logs, parity, memory estimate."""
