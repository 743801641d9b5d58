"""The publishing process: routing, submission and dedup of ML jobs."""
