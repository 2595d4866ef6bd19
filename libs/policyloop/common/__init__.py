"""Small helpers every layer may use (ports, clock). This package imports nothing else of
policyloop, so anything can depend on it."""
