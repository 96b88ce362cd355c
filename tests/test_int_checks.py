"""One integer-argument check (``cpdata.errors.check_int`` / ``is_int``) for every converted package.

The check is compared against the rule it replaced, written out once here:
``not isinstance(v, bool) and isinstance(v, (int, np.integer))``. A second
test fails if the hand-written form comes back in a package that uses the
check. ``optional=True`` (None passes) and the flag and choice checks beside it are pinned by their
messages.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cpdata.errors import NotAnIntError, check_bool, check_choice, check_int, is_int

ROOT = Path(__file__).resolve().parents[1] / "cpdata"
# packages (and files) whose integer arguments go through check_int / is_int
CONVERTED = ["packing", "schedule", "sources", "worker", "nemo", "bench", "device/consistency.py",
             "offline/precompute_plan.py", "offline/tokenize_files.py", "offline/precompute_cli.py", "layout/maps.py",
             "layout/exchange.py", "nodes", "device/attention_masks.py", "device/varlen.py"]  # fmt: skip
HAND_WRITTEN = re.compile(r"isinstance\(([\w.]+), bool\) or not isinstance\(\1, (int|\(int, np\.integer\)|numbers\.Integral)\)")


def _reference_is_int(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, np.integer))


VALUES = st.one_of(st.integers(), st.booleans(), st.floats(allow_nan=False), st.text(max_size=3), st.none(),
                   st.integers(-(2**62), 2**62).map(np.int64), st.integers(0, 255).map(np.uint8),
                   st.booleans().map(np.bool_))  # fmt: skip


@given(VALUES, st.one_of(st.none(), st.integers(-3, 3)))
def test_check_int_accepts_exactly_the_integers_at_or_above_the_bound(value, bound):
    ok = _reference_is_int(value) and (bound is None or value >= bound)
    if ok:
        got = check_int("count", value, min=bound)
        assert type(got) is int and got == value
        return
    with pytest.raises(ValueError) as err:  # every refusal is a ValueError, as cpdata promises
        check_int("count", value, min=bound, fix="; use 4")
    message = str(err.value)
    assert message.startswith("count must be an int") and message.endswith("; use 4") and repr(value) in message
    assert isinstance(err.value, TypeError) == (not _reference_is_int(value))  # wrong type: also a TypeError
    assert isinstance(err.value, NotAnIntError) == (not _reference_is_int(value))
    if bound is not None:
        assert f">= {bound}" in message
    assert is_int(value) == _reference_is_int(value)


@given(VALUES, st.integers(-3, 3))
def test_optional_check_int_also_passes_none_and_says_so(value, bound):
    if value is None:
        assert check_int("window", None, min=bound, optional=True) is None
        with pytest.raises(TypeError, match=rf"^window must be an int >= {bound}, got NoneType None$"):
            check_int("window", None, min=bound)  # not optional: None is refused
        return
    try:
        plain: object = check_int("window", value, min=bound)
    except ValueError as exc:
        plain = str(exc)
    try:
        got: object = check_int("window", value, min=bound, optional=True)
    except ValueError as exc:
        got = str(exc)
    if isinstance(plain, str):  # the same refusal, saying that None would do
        assert got == plain.replace(f">= {bound},", f">= {bound} or None,", 1) and "or None" in got
    else:
        assert got == plain == value


def test_check_bool_and_check_choice_name_the_value_and_what_would_do():
    for flag in (True, False):
        check_bool("shuffle", flag)
    check_bool("pin_memory", None, optional=True)
    for bad, shown in ((1, "int 1"), (np.bool_(True), "bool np.True_"), ("yes", "str 'yes'"), (None, "NoneType None")):
        with pytest.raises(TypeError, match=rf"^shuffle must be True or False, got {shown}$"):
            check_bool("shuffle", bad)
    with pytest.raises(TypeError, match=r"^pin_memory must be True or False, or None, got int 0$"):
        check_bool("pin_memory", 0, optional=True)
    check_choice("overflow policy", "split", ("error", "split"))
    check_choice("overflow policy", None, ("error", "split"), optional=True)
    for bad in ("wrap", None):
        with pytest.raises(ValueError, match=rf"^unknown overflow policy {bad!r}; choose one of \['error', 'split'\]$"):
            check_choice("overflow policy", bad, ("error", "split"))


def test_the_messages_name_the_argument_the_value_and_the_bound():
    with pytest.raises(ValueError, match=r"^capacity must be an int >= 1, got 0$"):
        check_int("capacity", 0, min=1)
    with pytest.raises(TypeError, match=r"^capacity must be an int >= 1, got float 2\.0$"):
        check_int("capacity", 2.0, min=1)
    with pytest.raises(TypeError, match=r"^seed must be an int, got bool True$"):
        check_int("seed", True)


def test_converted_packages_have_no_hand_written_int_check():
    files = [p for entry in CONVERTED for p in ((ROOT / entry).rglob("*.py") if (ROOT / entry).is_dir() else
                                                [ROOT / entry])]  # fmt: skip
    assert len(files) > 40  # the packages were really read
    found = [f"{p.relative_to(ROOT)}:{m.group(0)}" for p in files for m in HAND_WRITTEN.finditer(p.read_text("utf-8"))]
    assert not found, f"use cpdata.errors.check_int / is_int instead: {found}"
    assert HAND_WRITTEN.search("if isinstance(x, bool) or not isinstance(x, (int, np.integer)):")  # the pattern works


# the flag and choice checks have one home too (cpdata.errors.check_bool / check_choice)
HAND_WRITTEN_FLAG_OR_CHOICE = re.compile(r"if not isinstance\(([\w.]+), bool\):\s*\n\s*raise TypeError|"
                                         r"if ([\w.]+) not in ([\w.]+):\s*\n\s*raise ValueError\(f\"unknown ")


def test_converted_packages_have_no_hand_written_flag_or_choice_check():
    files = list(ROOT.rglob("*.py"))
    assert len(files) > 100
    found = [f"{p.relative_to(ROOT)}:{m.group(0)}" for p in files
             for m in HAND_WRITTEN_FLAG_OR_CHOICE.finditer(p.read_text("utf-8"))]  # fmt: skip
    assert not found, f"use cpdata.errors.check_bool / check_choice instead: {found}"
    for written in ("if not isinstance(flag, bool):\n    raise TypeError(f'...')",
                    "if tail not in TAIL_POLICIES:\n    raise ValueError(f\"unknown tail {tail!r}\")"):
        assert HAND_WRITTEN_FLAG_OR_CHOICE.search(written)  # the pattern works


def test_one_number_check_names_the_value_and_the_bound():
    import numpy as np

    from cpdata.errors import check_number

    assert check_number("w", 2) == 2.0 and check_number("w", np.float32(0.5)) == 0.5
    assert check_number("a", 0, positive=False) == 0.0
    for bad, shown in ((True, "bool True"), ("1", "str '1'"), (None, "NoneType None")):
        with pytest.raises(TypeError, match=rf"^w must be a number, got {shown}; fix it$"):
            check_number("w", bad, fix="; fix it")
    for bad, bound in ((0, "> 0"), (-1.5, "> 0"), (float("nan"), "> 0"), (float("inf"), "> 0")):
        with pytest.raises(ValueError, match=rf"^w must be finite and {bound}, got {bad!r}$"):
            check_number("w", bad)
    with pytest.raises(ValueError, match=r"^a must be finite and >= 0, got -1$"):
        check_number("a", -1, positive=False)


def test_no_hand_written_number_check_outside_the_one_home():
    """A refusal of a non-finite or non-positive number goes through check_number (the bench's row check, which
    names its row, is the one other finite test)."""
    found = [f"{p.relative_to(ROOT)}" for p in ROOT.rglob("*.py")
             if p.name != "errors.py" and p.relative_to(ROOT).as_posix() != "bench/runner.py"
             and "isfinite(" in p.read_text("utf-8")]  # fmt: skip
    assert not found, f"use cpdata.errors.check_number instead: {found}"
