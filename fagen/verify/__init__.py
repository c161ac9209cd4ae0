"""Verification: the float64 reference, Hypothesis strategies, tolerances, properties, the engine, mutants."""
