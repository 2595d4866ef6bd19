"""tinker: the Tinker HTTP API (the official SDK's routes); the learner trains, an engine samples."""
