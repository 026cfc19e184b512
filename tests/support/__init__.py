"""Helpers the tests share, by subject (``tests/conftest.py`` puts ``tests/`` on ``sys.path``, so
test modules import them as ``support.<subject>``). Fixtures live in the ``conftest.py`` files."""
