"""A broken matrix fails loudly, naming the file, the entry and the problem."""

from __future__ import annotations

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from unsloth.matrix import MatrixError, default_path, load_matrix

REAL = default_path().read_text(encoding="utf-8")


def broken(tmp_path, old: str, new: str):
    assert REAL.count(old) >= 1, f"test setup: {old!r} is not in the matrix"
    path = tmp_path / "matrix.toml"
    path.write_text(REAL.replace(old, new, 1), encoding="utf-8")
    with pytest.raises(MatrixError) as caught:
        load_matrix(path)
    message = str(caught.value)
    assert message.startswith(str(path))
    return message


def test_the_shipped_matrix_is_valid():
    matrix = load_matrix(default_path())
    assert len(matrix.support) == len(matrix.families) * len(matrix.oses)


BAD_ENTRIES = [
    ('family = "RDNA2"\nos = "linux"', 'family = "RDNA9"\nos = "linux"', "support for RDNA9: unknown family 'RDNA9'"),
    (
        'level = "limited"\nreason = "only gfx1030',
        'level = "partial"\nreason = "only gfx1030',
        "support for RDNA2: bad level 'partial'; expected one of full, limited, unsupported",
    ),
    (
        'family = "RDNA2"\nos = "linux"',
        'family = "RDNA2"\nos = "linux-gnu"',
        "support for RDNA2: unknown os 'linux-gnu'",
    ),
    (
        'variant = "cu130"\ncuda = "13.0"\ndriver = { linux = "580"',
        'variant = "cu130"\ncuda = "13.0"\ndriver = { linux = "58x"',
        "cuda_index 'cu130': 'driver.linux' = '58x' is not a version",
    ),
    (
        'sm = ["7.5", "12.1"]\ntorch = ">=2.9,<2.14"',
        'sm = ["12.1", "7.5"]\ntorch = ">=2.9,<2.14"',
        "cuda_index 'cu130': 'sm' range ['12.1', '7.5'] is reversed",
    ),
    (
        '[amd_wheels]\ntorch = ">=2.11,<2.14"',
        '[amd_wheels]\ntorch = "2.11+"',
        "amd_wheels: 'torch' '2.11+' is not a version specifier",
    ),
    (
        'variant = "cu126"\ncuda = "12.6"',
        'variant = "cu126"\ncuda = "12.6"\nsouce = "typo"',
        "cuda_index 'cu126': unknown key 'souce'",
    ),
    (
        'pytorch = "https://download.pytorch.org/whl"',
        'pytorch = "download.pytorch.org/whl"',
        "urls: 'pytorch' = 'download.pytorch.org/whl' is not an http(s) URL",
    ),
    ('variant = "cu128"', 'variant = "cu130"', "cuda_index 'cu130': duplicate row"),
    ('name = "CDNA4"', 'name = "CDNA3"', "family 'CDNA3': duplicate family"),
    ('archs = ["gfx950"]', 'archs = ["gfx942"]', "family 'CDNA4': arch 'gfx942' is also in family 'CDNA3'"),
    (
        'hsa_override = { gfx1103 = "11.0.0" }',
        'hsa_override = { gfx1103 = "eleven" }',
        "family 'RDNA3': 'hsa_override.gfx1103' = 'eleven' is not a version",
    ),
    (
        'hsa_override = { gfx1103 = "11.0.0" }',
        'hsa_override = { gfx1103 = "11.0" }',  # ROCm needs the stepping too
        "family 'RDNA3': 'hsa_override.gfx1103' = '11.0' is not a version MAJOR.MINOR.STEPPING",
    ),
    (
        'hsa_override = { gfx1103 = "11.0.0" }',
        'hsa_override = { gfx1199 = "11.0.0" }',
        "family 'RDNA3': arch 'gfx1199' is not in its archs",
    ),
    (
        'spec = "bitsandbytes>=0.46"',
        'spec = "bitsandbytes>=>0.46"',
        "bitsandbytes[0]: spec 'bitsandbytes>=>0.46' is not a requirement",
    ),
    ('backend = "metal"', 'backend = "opencl"', "llama_cpp[3]: bad backend 'opencl'"),
    (
        '"gfx1151", "gfx1200", "gfx1201"]\ntorch = ">=2.11',
        '"gfx1151", "gfx1200", "gfx9999"]\ntorch = ">=2.11',
        "rocm_index 'rocm7.2': 'archs' names arch 'gfx9999', which no family lists",
    ),
    ("overhead = 0.2", "overhead = -0.2", "fits: 'overhead' must be a non-negative number, got -0.2"),
    ("schema = 1", "schema = 2", "schema = 2, this unsloth reads schema = 1"),
    (
        'oses = ["linux", "wsl", "windows", "macos"]',
        'oses = ["linux", "wsl", "windows"]',
        "the planner needs exactly ['linux', 'wsl', 'windows', 'macos']",
    ),
    ('name = "CPU"', 'name = "NoGPU"', "missing family 'CPU' (the plan without a usable GPU)"),
    (
        'backend = "cpu"\nos = ["linux", "wsl", "windows", "macos"]',
        'backend = "cpu"\nos = ["linux"]',
        "llama_cpp needs a 'cpu' row for every OS",
    ),
    ('[attention]\ncuda = "sdpa"', '[attention]\ncuda = "sdpa"\nrocm6 = "sdpa"', "attention: unknown key 'rocm6'"),
    (
        'backend = "xpu"\nos = ["linux", "windows"]\nspec = "flash-linear-attention',
        'backend = "mps"\nos = ["linux", "windows"]\nspec = "flash-linear-attention',
        "flash_linear_attention 'mps': bad backend 'mps': its kernels are Triton, which runs on cuda, rocm, xpu GPUs only",
    ),
    (
        'spec = "flash-linear-attention==0.6.0"\nbroken_sm',
        'spec = "flash-linear-attentoin==0.6.0"\nbroken_sm',
        "flash_linear_attention 'cuda': spec 'flash-linear-attentoin==0.6.0' must name flash-linear-attention",
    ),
    (
        'spec = "flash-linear-attention==0.6.0"\nbroken_sm',
        'spec = "flash-linear-attention=0.6.0"\nbroken_sm',
        "flash_linear_attention 'cuda': 'spec' 'flash-linear-attention=0.6.0' is not a requirement",
    ),
    (
        'broken_triton = ">=3.4.0,<3.7.1"',
        'broken_triton = "3.4 to 3.7"',
        "flash_linear_attention 'cuda': 'broken_triton' '3.4 to 3.7' is not a version specifier",
    ),
    (
        'broken_triton = ">=3.4.0,<3.7.1"\n',
        "",
        "flash_linear_attention 'cuda': broken_sm and broken_triton go together",
    ),
    (
        'broken_sm = ["9.0", "9.9"]',
        'broken_sm = ["9.9", "9.0"]',
        "flash_linear_attention 'cuda': 'broken_sm' range ['9.9', '9.0'] is reversed",
    ),
    (
        'backend = "rocm"\nos = ["linux", "wsl"]\nspec = "flash-linear-attention==0.6.0"\n',
        'backend = "rocm"\nos = ["linux", "wsl"]\nspec = "flash-linear-attention==0.6.0"\nbroken_sm = ["9.0", "9.9"]\n'
        'broken_triton = ">=3.4.0"\n',
        "flash_linear_attention 'rocm': broken_sm names NVIDIA compute capabilities: only a 'cuda' row can have it",
    ),
    ('spec = "flash-linear-attention==0.6.0"\nbroken_sm', 'spec = "flash-linear-attention==0.6.0"\nbroken_gpus = []\nbroken_sm',
     "flash_linear_attention 'cuda': unknown key 'broken_gpus'"),
    ('releases = { "2.8.0" = "3.4.0"', 'releases = { "2.8.x" = "3.4.0"', "torch_triton: 'releases' = '2.8.x' is not a version"),
    ('releases = { "2.8.0" = "3.4.0"', 'releases = { "2.8.0" = 3.4', "torch_triton: 'releases' must be a table of strings"),
    ("\n[torch_triton]\n", "\n[no_torch_triton]\n",
     "a flash_linear_attention row has broken_triton, but there is no [torch_triton] table"),
]


@pytest.mark.parametrize(
    ("old", "new", "expected"), BAD_ENTRIES, ids=[case[2].split(":")[-1].strip()[:40] for case in BAD_ENTRIES]
)
def test_bad_entry_is_named(tmp_path, old, new, expected):
    assert expected in broken(tmp_path, old, new)


def test_duplicate_cell(tmp_path):
    row = '[[support]]\nfamily = "Ada"\nos = "linux"\nlevel = "full"\nreason = "again"\nsource = "x"\n\n'
    message = broken(tmp_path, '[[support]]\nfamily = "Kepler"', row + '[[support]]\nfamily = "Kepler"')
    assert "duplicate row: Ada x linux is already covered" in message


def test_missing_source(tmp_path):
    start = REAL.index('variant = "cu126"')
    source_line = REAL[start:].index("source = ") + start
    end = REAL.index("\n", source_line)
    path = tmp_path / "matrix.toml"
    path.write_text(REAL[:source_line] + REAL[end + 1 :], encoding="utf-8")
    with pytest.raises(MatrixError, match=r"cuda_index 'cu126': missing 'source'"):
        load_matrix(path)


def test_missing_cell(tmp_path):
    message = broken(
        tmp_path,
        'family = "CPU"\nos = ["linux", "wsl", "windows", "macos"]',
        'family = "CPU"\nos = ["linux", "wsl", "windows"]',
    )
    assert "support has no row for CPU x macos" in message


def test_not_toml(tmp_path):
    message = broken(tmp_path, "[urls]", "[urls")
    assert "not valid TOML" in message


def test_environment_variable_points_at_the_matrix(tmp_path, monkeypatch):
    custom = tmp_path / "mine.toml"
    custom.write_text(
        REAL.replace(
            'level = "limited"\nreason = "CUDA 13 wheels dropped Pascal',
            'level = "full"\nreason = "CUDA 13 wheels dropped Pascal',
        ),
        encoding="utf-8",
    )
    monkeypatch.setenv("UNSLOTH_MATRIX", str(custom))
    matrix = load_matrix()
    assert matrix.path == str(custom)
    assert matrix.cell("Pascal", "linux").level == "full"

    monkeypatch.setenv("UNSLOTH_MATRIX", str(tmp_path / "missing.toml"))
    with pytest.raises(MatrixError, match=r"missing\.toml \(set by UNSLOTH_MATRIX\): cannot read the hardware matrix"):
        load_matrix()
    assert load_matrix(default_path()).cell("Pascal", "linux").level == "limited"  # an argument wins


def test_the_packaged_matrix_is_a_real_file_and_the_root_one_its_exact_copy():
    """A symlink breaks a Windows checkout without symlinks. The repository shows the matrix at its
    root, where users look; the package ships its copy, so the two must be the same bytes."""
    path = default_path()
    assert path.is_file() and not path.is_symlink()
    assert load_matrix(path).families
    root = path.parents[2]
    top = root / "hardware_matrix.toml"
    assert top.is_file() and not top.is_symlink()
    assert top.read_bytes() == path.read_bytes(), "edit both: cp src/unsloth/hardware_matrix.toml hardware_matrix.toml"
    pyproject = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    assert "hardware_matrix.toml" in pyproject["tool"]["setuptools"]["package-data"]["unsloth"]  # shipped in the wheel
