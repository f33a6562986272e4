"""The work queue and what the worker keeps beside it: jobs and items in SQLite, the failure
log, the worker's owner lock, and why a sample is (not) ready."""
