"""learner: trains on Trajectories and produces new policy versions."""
