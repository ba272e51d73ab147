"""In-process fakes of external services, for tests."""
