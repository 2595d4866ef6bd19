"""The Tinker API on a policyloop cluster: users' own training loops, written with the official
`tinker` SDK, executed by the cluster's learner (forward/backward, optimizer steps, checkpoints)
and engines (sampling), over the bus and the publisher like the rest of the loop."""
