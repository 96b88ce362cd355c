"""NeMo's sharder contract lives in ``cpdata/nemo`` alone; ``cpdata/device`` is the native path only.

The emulation of NeMo Automodel's in-step sharding (raw batches laid out on the
device, THD and pipeline chunks, backend resolution, token verbs) is named
here by its modules and the names each defines. The test fails if one of those
names is defined anywhere but its ``cpdata.nemo`` module (a copy, or a module
moved back into the device package), if a module of that name appears in
``cpdata/device``, or if the device package imports ``cpdata.nemo`` or speaks
NeMo's batch keys.
"""

from __future__ import annotations

import ast
from pathlib import Path

import cpdata

ROOT = Path(__file__).resolve().parents[1] / "cpdata"

EMULATION: dict[str, set[str]] = {
    "sharder": {"ContextParallelSharder"},
    "resolve": {"Strategy", "resolve_strategy", "attention_backend", "uses_te_attention", "submesh", "mesh_device"},
    "raw_shard": {"DeviceShard", "shard_identity", "closed_form_indices", "check_undeclared", "primary_key"},
    "thd_batch": {"ThdStream", "to_thd_stream", "shard_thd_stream", "SEQ_LENS_SENTINEL"},
    "thd_shard": {"ThdShard", "THD_LOCAL_INDICES", "split_thd_chunks"},
    "token_coords": {"to_padded_stream", "trim_to_caller"},
}
# batch keys and hooks of NeMo's contract that only the emulation reads
NEMO_WORDS = ("prepare_model_inputs_for_cp", "seq_lens_padded", "_thd_local_indices", "num_chunks")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def test_each_emulation_name_is_defined_once_in_its_nemo_module():
    defined: dict[str, list[str]] = {}
    for path in ROOT.rglob("*.py"):
        for name in _top_level_names(ast.parse(path.read_text(encoding="utf-8"))):
            defined.setdefault(name, []).append(_module_name(path))
    wrong = {
        name: sorted(defined.get(name, []))
        for stem, names in EMULATION.items()
        for name in names
        if defined.get(name, []) != [f"cpdata.nemo.{stem}"]
    }
    assert not wrong, f"NeMo-emulation names must be defined once, in their cpdata.nemo module: {wrong}"
    assert cpdata.ContextParallelSharder.__module__ == "cpdata.nemo.sharder"  # the public name is the room's class


def test_the_device_package_holds_no_emulation_module_and_does_not_import_it():
    device = sorted(ROOT.joinpath("device").glob("*.py"))
    assert len(device) >= 4, device  # the native modules were really read
    back = sorted(p.stem for p in device if p.stem in EMULATION)
    assert not back, f"NeMo-emulation modules {back} belong in cpdata/nemo, not cpdata/device"
    for path in [*device, ROOT / "gather.py"]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not any(m == "cpdata.nemo" or m.startswith("cpdata.nemo.") for m in imported), path
        code_only = ast.unparse(_without_docstrings(tree))  # docstrings may point at cpdata.nemo; code may not
        found = [w for w in NEMO_WORDS if w in code_only]
        assert not found, f"{path.name} uses NeMo's contract {found}: that code belongs in cpdata/nemo"


def test_the_nemo_room_really_holds_the_contract():
    nemo_code = "".join(p.read_text(encoding="utf-8") for p in ROOT.joinpath("nemo").glob("*.py"))
    assert all(w in nemo_code for w in NEMO_WORDS)  # the words the device test looks for are really the contract's


def _without_docstrings(tree: ast.Module) -> ast.Module:
    """``tree`` with every string statement (module, class, function and attribute docstrings) dropped."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            node.body = [s for s in node.body if not _is_docstring(s)] or [ast.Pass()]
    return tree


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
