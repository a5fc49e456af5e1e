"""Dedup stores: SQL (transactional and lease), Redis (lease) and in-memory (tests, demos)."""
