"""Policy weights: the version store behind the publisher and the WeightService client."""
