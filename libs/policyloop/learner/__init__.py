"""The learner role: settings (settings.py), held trajectories (held.py), the step in its
write-ahead order (learner.py), resume (start.py), figures (figures.py), the colocated
broadcast (colocated.py) and torchrun's other ranks (follow.py). services/learner wires it to a
process. Modules are imported by name: the settings load without torch."""
