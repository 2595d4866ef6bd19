"""The gateway role: LoopService over gRPC (`servicer`), request validation (`validation`,
`code_checks`, `model_context`), and feeding runs' Tasks into TASKS (`feeding`, `feeder`)."""
