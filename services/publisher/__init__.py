"""publisher: stores policy versions, serves them over gRPC, announces them on WEIGHTS."""
