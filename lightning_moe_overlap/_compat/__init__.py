"""The one seam to other libraries' private names: one module per library (``lightning``, ``torch``,
``transformers``).

No other module of the package names a private attribute of Lightning or torch; each name here has a test that
fails with the library's version when the library changes it (``tests/unit/test_compat_*.py``).
"""
