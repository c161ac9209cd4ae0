"""The command line, through click's CliRunner."""

import pytest
from click.testing import CliRunner

import fagen
from fagen.cli import COMMANDS, main


def run(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.mark.parametrize("command", [[]] + [[name] for name in COMMANDS])
def test_help(command):
    """Every command's --help (and the group's, which lists every command's whole summary)."""
    result = run(*command, "--help")
    assert result.exit_code == 0 and "Usage:" in result.output
    if not command:
        assert all(summary in " ".join(result.output.split()) for _, _, summary in COMMANDS.values())
    else:
        assert "Examples" in result.output


@pytest.mark.parametrize("text, message", [
    ("[]", "must be a JSON object of spec fields"),
    ("null", "must be a JSON object of spec fields"),
    ('"x"', "must be a JSON object of spec fields"),
    (b"\xff\xfe{", "is not UTF-8 text"),
    ('{"head_dim": 64, "maks": 1, "dtyp": 2}', "unknown spec fields (did you mean mask, dtype?); known fields"),
])
def test_a_spec_file_that_is_not_a_spec_object_is_one_line(tmp_path, text, message):
    """Issue 18: these gave a 26-33-line traceback from the CLI."""
    spec_file = tmp_path / "k.json"
    spec_file.write_bytes(text if isinstance(text, bytes) else text.encode())
    result = CliRunner().invoke(main, ["generate", "--spec", str(spec_file), "-o", str(tmp_path / "out")])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and str(spec_file) in lines[0], result.output
    assert not (tmp_path / "out").exists()
    if isinstance(text, str) and "maks" in text:
        assert "maks, dtyp" in lines[0]


def test_malformed_toml_names_the_line_without_echoing_the_file(tmp_path):
    spec_file = tmp_path / "k.toml"
    spec_file.write_text("head_dim = 64\n" + "# filler\n" * 50 + "mask = \n")
    result = CliRunner().invoke(main, ["generate", "--spec", str(spec_file)])
    assert result.exit_code == 1 and "not valid TOML" in result.output and "filler" not in result.output
    assert "line 52" in result.output


def test_an_unwritable_output_folder_is_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    result = CliRunner().invoke(main, ["generate", "--head-dim", "64", "-o", str(blocker / "out")])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert result.output.startswith("Error: cannot write") and "choose a writable output folder" in result.output


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
        f"Error: {spec_file}: maks: got 'tree'; unknown spec field (did you mean mask?); known fields: alibi, backend, "
        "block_m, block_n, direction, dtype, gqa, head_dim, head_dim_v, kind, kv_dtype, layout, mask, mask_mod, "
        "mod_scalars, mod_tensors, num_stages, num_warps, score_mod, shared_kv, sinks, softcap, window"]


def test_generate_without_spec_renders_the_default_catalog(tmp_path):
    result = run("generate", "-o", str(tmp_path))
    assert result.exit_code == 0, result.output
    from fagen.spec.manifest import DEFAULT_CATALOG, load_manifest
    from fagen import backends
    names = {s.name + backends.get(s.backend).suffix for s in load_manifest(DEFAULT_CATALOG).specs}
    assert {p.name for p in tmp_path.iterdir()} == names
    # A variant the catalog no longer has (a renamed default) is removed on the next render; other files stay.
    (tmp_path / "attn_fwd_full_d64_m16n16w1s1_g1_fp16.py").write_text("# Generated by fagen 0.0.1 from spec x.\n")
    (tmp_path / "notes.py").write_text("# mine\n")
    result = run("generate", "-o", str(tmp_path))
    assert result.exit_code == 0 and "1 stale removed" in result.output, result.output
    assert {p.name for p in tmp_path.iterdir()} == names | {"notes.py"}
