"""The Trainer callback: its options, where its results go, its error log, suite schedules."""
