"""Protobuf contracts. `policyloop.contracts.v1` holds the code generated from protos/."""

from policyloop.contracts.v1 import bus_pb2, loop_pb2, weights_pb2

__all__ = ["bus_pb2", "loop_pb2", "weights_pb2"]
