"""gateway: the gRPC LoopService; turns runs into Tasks on TASKS."""
