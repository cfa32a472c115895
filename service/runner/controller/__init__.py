"""The job runner's controller: its states, the pure decision that moves them, and what it asks the runner to do."""
