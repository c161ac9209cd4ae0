"""The command line, through click's CliRunner."""

import pytest
from click.testing import CliRunner

import fagen
from fagen.cli import main


def run(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.mark.parametrize("command", [[]] + [[name] for name in main.commands])
def test_help(command):
    result = run(*command, "--help")
    assert result.exit_code == 0 and "Usage:" in result.output


def test_generate_writes_the_triton_source(tmp_path):
    result = run("generate", "--head-dim", "64", "--mask", "causal", "--gqa", "4", "--dtype", "bf16",
                 "-o", str(tmp_path))
    assert result.exit_code == 0, result.output
    [path] = tmp_path.iterdir()
    spec = fagen.KernelSpec(head_dim=64, mask="causal", gqa=4, dtype="bf16")
    assert path.name == spec.name + ".py"
    assert path.read_text() == fagen.generate(spec)
    again = run("generate", "--head-dim", "64", "--mask", "causal", "--gqa", "4", "--dtype", "bf16",
                "-o", str(tmp_path))
    assert "up to date" in again.output


def test_bad_head_dim_names_the_flag_and_writes_nothing(tmp_path):
    result = run("generate", "--head-dim", "12", "-o", str(tmp_path / "out"))
    assert result.exit_code == 2
    assert "--head-dim" in result.output and "got 12" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_bad_choice_exits_2():
    result = run("generate", "--head-dim", "64", "--mask", "diagonal")
    assert result.exit_code == 2 and "'diagonal' is not one of" in result.output


def test_spec_file_and_flag_override(tmp_path):
    spec_file = tmp_path / "k.toml"
    spec_file.write_text('head_dim = 96\nmask = "tree"\ngqa = 8\n')
    result = run("generate", "--spec", str(spec_file), "--dtype", "bf16", "-o", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    expected = fagen.KernelSpec(head_dim=96, mask="tree", gqa=8, dtype="bf16")
    assert (tmp_path / "out" / f"{expected.name}.py").exists()


def test_bad_spec_file_is_one_clear_line(tmp_path):
    spec_file = tmp_path / "k.json"
    spec_file.write_text('{"head_dim": 64, "maks": "tree"}')
    result = run("generate", "--spec", str(spec_file))
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        f"Error: {spec_file}: maks: got 'tree'; unknown spec field; known fields: backend, block_m, block_n, "
        "direction, dtype, gqa, head_dim, kind, mask, num_stages, num_warps"]


def test_generate_without_spec_renders_the_default_catalog(tmp_path):
    result = run("generate", "-o", str(tmp_path))
    assert result.exit_code == 0, result.output
    from fagen.manifest import DEFAULT_CATALOG, load_manifest
    from fagen.tables import SOURCE_SUFFIX
    names = {s.name + SOURCE_SUFFIX[s.backend] for s in load_manifest(DEFAULT_CATALOG).specs}
    assert {p.name for p in tmp_path.iterdir()} == names
