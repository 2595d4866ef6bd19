"""The six services. Each folder holds one service's settings, wiring and loop; the logic they
call lives in the library (policyloop.*)."""
