"""Library fault catalogue: wrong resumes, empty states, bad configs, ignored options, empty data.

Each case is a silent wrong result or an unclear crash that must now be either correct
behaviour or a clear error naming the field / file / value; the expected message is asserted.
"""

from __future__ import annotations

import re

import pytest

from megatron_packing.config import ConfigError, PackingConfig, load_config


# --------------------------------------------------------------------------- item 12 + YAML
def write(tmp_path, text: str, name: str = "train.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_fp8_recipe_without_fp8_enabled_is_refused(tmp_path):
    path = write(tmp_path, "packing:\n  fp8_recipe: mxfp8\n")
    with pytest.raises(ConfigError, match=re.escape(str(path)) + ".*fp8_recipe='mxfp8' is set but "
                       "fp8_enabled is False.*set fp8_enabled: true, or remove fp8_recipe"):
        load_config(path)
    with pytest.raises(ConfigError, match="fp8_enabled"):
        PackingConfig(fp8_recipe="delayed").validate()
    assert PackingConfig(fp8_enabled=True, fp8_recipe="mxfp8", bin_capacity=4096).validate()


@pytest.mark.parametrize("text, kind", [
    ("- global_batch_size: 64\n- bin_capacity: 1024\n", "list"),
    ("[]\n", "list"),
    ("42\n", r"scalar \(int\)"),
    ("just words\n", "string"),
])
def test_a_top_level_list_or_scalar_is_refused(tmp_path, text, kind):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=re.escape(str(path)) + ": expected a mapping of keys at "
                       f"the top level.*got a YAML {kind}"):
        load_config(path)


def test_a_packing_section_that_is_not_a_mapping_is_refused(tmp_path):
    path = write(tmp_path, "packing:\n  - 1\n  - 2\n")
    with pytest.raises(ConfigError, match=re.escape(str(path)) + ".*expected a mapping.*got list"):
        load_config(path)


@pytest.mark.parametrize("text, line", [
    ("packing:\n  global_batch_size: 64\n  seed: [1, 2\n", 4),
    ("packing:\n  global_batch_size: 64\n\tbin_capacity: 1024\n", 3),
    ("packing:\n  a: 1\n b: 2\n", 3),
])
def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path, text, line):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=re.escape(f"{path}: not valid YAML at line {line}, ")):
        load_config(path)
