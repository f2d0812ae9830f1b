"""What the tests share, imported as ``tests.support.<module>`` (pyproject's pytest ``pythonpath`` puts the
repository root on ``sys.path``): skip markers (``markers``), the session fixtures (``fixtures``, registered by
tests/conftest.py), kernel problems and their checks (``kernel_cases``, ``paged_cases``), the sm_90 compile cases
(``sm90_compile``), trainer transports (``transport``) and run-isolation checks (``isolation``)."""
