"""The rollout role: settings (settings.py), the replica's work on TASKS (replica.py), the engine
requests and records of a group (records.py), following WEIGHTS into the engine (follower.py),
engine health (health.py) and the embedded engine as a child process (engine_process.py); episodes
are envs' (episode.py, tool_episodes.py). services/rollout wires it to a process."""
