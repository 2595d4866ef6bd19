"""Serving: an OpenAI-compatible endpoint over an engine (the SGLang protocol) that records every
request and response as a trace, with the engine's exact token ids and weights version, and the
feedback callers attach to it; and the export of traces as training data."""
