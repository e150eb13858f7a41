"""Results and statistics: metrics, intervals and tests, token-level results, flips, runs and curves."""
