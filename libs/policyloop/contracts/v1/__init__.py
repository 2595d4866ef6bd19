"""Generated from protos/policyloop/v1 by `make protos`; do not edit."""
