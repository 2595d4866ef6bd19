"""The demos: policyloop's own tasks run on the local cluster end to end (`policyloop demo`: the RL
run and its LoRA runs, the production loop, an agent that learns from its sessions, the tally
desk), built on the library; nothing in the library imports them (the import-layer test says so).
"""
