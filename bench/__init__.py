"""Benchmarks of flask-idem: ``bench/run.py`` (load, one table) and ``bench/roundtrips.py`` (round trips).

See ``bench/README.md``. Nothing here is imported by the package or the tests.
"""
