"""The GPU tests use the integration tests' tiny pretrained Sudoku model (fixtures of a conftest apply
only below its folder, so it is imported here)."""

from tests.integration.conftest import tiny_sudoku_model  # noqa: F401  (a pytest fixture)
