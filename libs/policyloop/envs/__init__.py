"""Environments: the built-in task sets (arithmetic, code) and multi-turn episodes with tools."""
