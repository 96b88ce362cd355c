"""What a user meets first: the installed package, the command line, the license, warnings and typos."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import cpdata
from cpdata.cli import cli_wording
from cpdata.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]


def _docs(n: int = 12) -> list[dict[str, np.ndarray]]:
    return [{"input_ids": np.arange(3 + i % 5, dtype=np.int64)} for i in range(n)]


# ------------------------------------------------------------------------------------------ packaging


def test_license_file_matches_pyproject():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'license = "Apache-2.0"' in pyproject and 'license-files = ["LICENSE"]' in pyproject
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n                           Version 2.0, January 2004")
    assert "END OF TERMS AND CONDITIONS" in text and "9. Accepting Warranty or Additional Liability" in text


def test_recipes_are_in_the_installed_package_and_pipelines_reexports_them():
    from setuptools import find_packages

    installed = find_packages(str(ROOT), include=["cpdata*"])
    assert "cpdata.recipes" in installed and not any(p.startswith("pipelines") for p in installed)
    from cpdata.recipes import sft_thd
    from pipelines import sft_thd as entry

    assert entry is sft_thd


# ------------------------------------------------------------------------------------------ command line


def test_version_and_user_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"cpdata {cpdata.__version__}"
    assert cli_main([]) == 2
    out = capsys.readouterr().out
    assert "context-parallel training batches" in out and "typical use:" in out
    assert "``" not in out and "subcommand module" not in out  # not the module docstring
    for command in ("bench", "inspect", "precompute"):
        assert f"\n    {command}" in out


def test_inspect_of_a_missing_path_says_it_does_not_exist(tmp_path, capsys):
    assert cli_main(["inspect", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path / 'missing'} does not exist" in err
    assert "manifest" not in err


def test_precompute_errors_name_the_flags(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"input_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]}\n')
    out = tmp_path / "plan"
    args = ["precompute", str(data), "--cp-size", "1", "--layout", "identity", "--out", str(out), "--quiet"]
    assert cli_main([*args, "--capacity", "8"]) == 1
    err = capsys.readouterr().err
    assert "pass --overflow one of ['drop', 'split', 'truncate']" in err and "overflow=" not in err
    assert "more than --capacity 8" in err
    out.mkdir()
    assert cli_main([*args, "--capacity", "16"]) == 1
    err = capsys.readouterr().err
    assert "already exists; pass --force" in err and "overwrite" not in err


def test_cli_wording_leaves_unknown_names_and_paths_alone():
    flags = ["capacity", "cp_size", "force", "overflow"]
    assert cli_wording("cp_size=2 and seed=3", flags) == "--cp-size 2 and seed=3"
    assert cli_wording("pass overwrite=True (--force)", flags) == "pass --force"
    assert cli_wording("file a/capacity=1.jsonl", flags) == "file a/capacity=1.jsonl"
    assert cli_wording("pass overwrite=True", ["capacity"]) == "pass overwrite=True"


def test_console_script_version():
    exe = Path(sys.executable).parent / "cpdata"
    proc = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == f"cpdata {cpdata.__version__}"


# ------------------------------------------------------------------------------------------ Python API


def test_unknown_keywords_name_the_public_function():
    from cpdata import CPDataset, build_loader

    common = {"capacity": 16, "cp_size": 1, "cp_rank": 0, "layout": "identity"}
    with pytest.raises(TypeError, match=r"^build_loader\(\) got an unexpected keyword argument 'capacty'; "
                                        r"did you mean 'capacity'\?"):
        build_loader(_docs(), **common, capacty=3)
    with pytest.raises(TypeError, match=r"^CPDataset\(\) got an unexpected keyword argument 'algoritm'; "
                                        r"did you mean 'algorithm'\?"):
        CPDataset(_docs(), **common, algoritm="bfd")
    with pytest.raises(TypeError, match=r"^CPDataset\(\) got an unexpected keyword argument 'zzz'; it takes "):
        CPDataset(_docs(), **common, zzz=1)
    with pytest.raises(TypeError, match=r"^CPDataset\(\) is missing the keyword argument 'cp_size'"):
        CPDataset(_docs(), capacity=16, cp_rank=0, layout="identity")


def test_constructing_a_stateful_dataloader_over_cpdata_emits_no_set_vital_warning():
    from torchdata.stateful_dataloader import StatefulDataLoader

    from cpdata import CPDataLoader, CPDataset

    with warnings.catch_warnings(record=True) as control:
        warnings.simplefilter("always")
        StatefulDataLoader(list(range(4)))
    assert any("set_vital" in str(w.message) for w in control), "torchdata no longer warns; drop the filter"

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dataset = CPDataset(_docs(), capacity=16, cp_size=1, cp_rank=0, layout="identity")
        loader = StatefulDataLoader(dataset, batch_size=None, num_workers=0)
        batches = list(loader)
        warnings.resetwarnings()  # drop the filter: cpdata's own loader must install it again
        warnings.simplefilter("always")
        assert list(CPDataLoader(dataset)), "CPDataLoader yields the same batches"
        warnings.warn("other warnings still show", UserWarning, stacklevel=1)
    assert batches
    messages = [str(w.message) for w in caught]
    assert not any("set_vital" in m for m in messages), messages
    assert "other warnings still show" in messages
