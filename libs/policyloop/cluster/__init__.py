"""Running the loop's processes: the service catalogue and the local cluster launcher."""
