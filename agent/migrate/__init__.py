"""Scenario A: a Hugging Face model into a new recipe (acquire, check, vendor)."""
