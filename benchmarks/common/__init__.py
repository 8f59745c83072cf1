"""What several benchmarks (and the tests that check runs) share."""
