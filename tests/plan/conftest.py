import pytest

from unsloth.matrix import default_path, load_matrix


@pytest.fixture(scope="session")
def matrix():
    """The packaged matrix, whatever UNSLOTH_MATRIX says in the developer's shell."""
    return load_matrix(default_path())
