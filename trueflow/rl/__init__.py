"""What the algorithm is (advantages, losses), independent of engines and models."""
