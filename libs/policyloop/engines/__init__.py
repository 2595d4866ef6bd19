"""Engines: SGLang's native HTTP protocol, the SGLang client, and the embedded engine."""
