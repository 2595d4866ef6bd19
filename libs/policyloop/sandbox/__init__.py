"""Isolated execution of untrusted code (jobs from the SANDBOX stream)."""
