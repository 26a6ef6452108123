import pytest
import yaml

from eqc_utils.params import ParamsError, load_params, parse_override
from eqc_utils.paths import PARAMS_DIR


def write_profile(tmp_path, mutate):
    raw = yaml.safe_load((PARAMS_DIR / "tiny.yaml").read_text())
    raw["profile"] = "broken"
    mutate(raw)
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def write_tiny_text(tmp_path, name, edit):
    """params/tiny.yaml as text, its profile renamed after the file, with `edit(text)` applied."""
    text = (PARAMS_DIR / "tiny.yaml").read_text().replace("profile: tiny", f"profile: {name}", 1)
    path = tmp_path / f"{name}.yaml"
    path.write_text(edit(text))
    return path


def replace_line(text, start, new):
    """Replace the one line that starts with `start` (indentation included)."""
    lines = text.splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if line.startswith(start)]
    assert len(hits) == 1, (start, hits)
    lines[hits[0]] = new + "\n"
    return "".join(lines)


@pytest.mark.parametrize("profile", sorted(p.stem for p in PARAMS_DIR.glob("*.yaml")))
def test_every_shipped_profile_validates(profile):
    params = load_params(profile)
    assert params["profile"] == profile


def test_unknown_key_names_file_and_key(tmp_path):
    path = write_profile(tmp_path, lambda r: r["prompts"].update(oversampel=1.2))
    with pytest.raises(ParamsError, match=r"broken\.yaml.*unknown key 'prompts\.oversampel'"):
        load_params(str(path))


def test_wrong_type_names_key_and_expected_type(tmp_path):
    path = write_profile(tmp_path, lambda r: r["prompts"].update(shuffle_seed="zero"))
    with pytest.raises(ParamsError, match=r"broken\.yaml.*'prompts\.shuffle_seed' expects integer, got str"):
        load_params(str(path))


def test_missing_key_is_reported(tmp_path):
    path = write_profile(tmp_path, lambda r: r["prompts"].pop("oversample"))
    with pytest.raises(ParamsError, match=r"missing key 'prompts\.oversample'"):
        load_params(str(path))


def test_enum_and_nested_quota_types(tmp_path):
    path = write_profile(tmp_path, lambda r: r["prompts"].update(source="web"))
    with pytest.raises(ParamsError, match=r"'prompts\.source' expects one of 'local', 'nemotron'"):
        load_params(str(path))
    path = write_profile(tmp_path, lambda r: r["prompts"]["stage2_quotas"].update(chat=1.5))
    with pytest.raises(ParamsError, match=r"'prompts\.stage2_quotas\.chat' expects integer"):
        load_params(str(path))


def test_cli_overrides_are_parsed_typed_and_validated():
    assert parse_override("prompts.oversample=1.5") == ("prompts.oversample", 1.5)
    assert parse_override("qad.lr=1e-5") == ("qad.lr", 1e-5)
    assert parse_override("prompts.default_system_prompt=Be brief.") == ("prompts.default_system_prompt", "Be brief.")
    params = load_params("tiny", ["prompts.oversample=2", "prompts.manifest=null"])
    assert params["prompts"]["oversample"] == 2.0 and isinstance(params["prompts"]["oversample"], float)
    with pytest.raises(ParamsError, match="unknown key 'prompts.nope'"):
        load_params("tiny", ["prompts.nope=1"])
    with pytest.raises(ParamsError, match="expects integer"):
        load_params("tiny", {"seed": "x"})
    with pytest.raises(ParamsError, match="KEY=VALUE"):
        load_params("tiny", ["seed"])


def test_unknown_profile_lists_known_ones():
    with pytest.raises(ParamsError, match="available profiles: .*tiny"):
        load_params("nonexistent")


def test_duplicate_key_names_file_key_and_lines(tmp_path):
    # PyYAML's safe_load keeps the last of two equal keys without a word
    path = write_tiny_text(tmp_path, "dup", lambda t: replace_line(t, "  lr: 5.0e-5", "  lr: 5.0e-5\n  lr: 1.0e-2"))
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if text.startswith("  lr: 5.0e-5"))
    with pytest.raises(ParamsError, match=rf"dup\.yaml: key 'qad\.lr' given twice \(line {line} and line {line + 1}\)"):
        load_params(str(path))
    top = write_tiny_text(tmp_path, "dup_top", lambda t: t + "seed: 1\n")
    with pytest.raises(ParamsError, match=r"dup_top\.yaml: key 'seed' given twice"):
        load_params(str(top))


def test_float_written_without_a_dot_is_a_float(tmp_path):
    # YAML 1.1 reads `5e-5` as the string '5e-5'; on the command line `-p qad.lr=5e-5` was always a float
    path = write_tiny_text(tmp_path, "exp", lambda t: replace_line(t, "  lr: 5.0e-5", "  lr: 5e-5"))
    params = load_params(str(path))
    assert params["qad"]["lr"] == 5e-5 and isinstance(params["qad"]["lr"], float)
    assert load_params("tiny", ["qad.lr=5e-5"])["qad"] == params["qad"]
    assert load_params("tiny", {"qad.betas": ["9e-1", 0.95]})["qad"]["betas"] == [0.9, 0.95]


@pytest.mark.parametrize("key, value, expected", [
    ("seed", "5", "expects integer, got str"),                       # no string becomes an int
    ("generation.max_tokens", "5e3", "expects integer, got str"),
    ("prompts.default_system_prompt", 5, "expects string, got int"),  # no int becomes a string
    ("assets.hub_allowed", "true", "expects boolean, got str"),
    ("qad.lr", "fast", "expects number, got str"),
    ("qad.lr", "inf", "expects number, got str"),                     # only plain number text is read
    ("qad.lr", True, "expects number, got bool"),
    ("generation.thinking", False, "quote the value"),                # YAML's `off`
])
def test_no_other_type_is_coerced(key, value, expected):
    with pytest.raises(ParamsError, match=expected):
        load_params("tiny", {key: value})


def test_cli_values_keep_their_written_type():
    assert load_params("tiny", ["generation.thinking=off"])["generation"]["thinking"] == "off"
    assert load_params("tiny", ['pack.ct_version="0.17"'])["pack"]["ct_version"] == "0.17"
    assert load_params("tiny", ["prompts.default_system_prompt=inf"])["prompts"]["default_system_prompt"] == "inf"
    with pytest.raises(ParamsError, match=r"'seed' expects integer, got str \('5'\)"):
        load_params("tiny", ['seed="5"'])


def test_profile_cannot_be_overridden():
    # it would send the tiny profile's results into runs/paper/
    with pytest.raises(ParamsError, match="'profile' cannot be overridden"):
        load_params("tiny", ["profile=paper"])
    with pytest.raises(ParamsError, match="'profile' cannot be overridden"):
        load_params("tiny", {"profile": "tiny"})


def test_profile_key_must_match_the_file_name(tmp_path):
    # a copy of tiny.yaml that keeps `profile: tiny` would share (and overwrite) runs/tiny/
    copy = tmp_path / "mine.yaml"
    copy.write_text((PARAMS_DIR / "tiny.yaml").read_text())
    with pytest.raises(ParamsError, match=r"mine\.yaml: profile 'tiny' does not match the file name.*profile: mine"):
        load_params(str(copy))


def test_missing_profile_file_reports_the_paths_tried(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ParamsError) as err:
        load_params("x.yaml")
    message = str(err.value)
    assert f"tried {tmp_path / 'x.yaml'}, {PARAMS_DIR / 'x.yaml'}" in message, message
    assert "x.yaml.yaml" not in message and "available profiles: " in message and "tiny" in message
    with pytest.raises(ParamsError) as err:
        load_params(str(tmp_path / "sub" / "x.yaml"))
    assert f"(tried {tmp_path / 'sub' / 'x.yaml'})" in str(err.value)
    assert load_params("tiny.yaml")["profile"] == "tiny"  # a bare file name is also looked for in params/
