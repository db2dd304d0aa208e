"""What the tests share and are not tests: servers and proxies they start, the small applications they
drive, and helpers. Fixtures stay in ``tests/conftest.py``."""
