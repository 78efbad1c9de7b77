"""The typed stubs (_core.pyi) name exactly what the native module has: a stub that drifts
from the module misleads every type checker downstream (a small stand-in for stubtest)."""

from __future__ import annotations

import ast
from pathlib import Path

import pagedrs._core as core

STUB = Path(__file__).resolve().parents[1] / "python" / "pagedrs" / "_core.pyi"


def _stub_members() -> dict[str, set[str]]:
    tree = ast.parse(STUB.read_text())
    members: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names = set()
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    names.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
            members[node.name] = names
        elif isinstance(node, ast.FunctionDef):
            members[node.name] = set()
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):  # a module constant
            members[node.target.id] = set()
    return members


def test_every_public_name_of_the_module_is_stubbed_and_vice_versa():
    stubbed = _stub_members()
    public = {n for n in dir(core) if not n.startswith("_")}
    assert public == set(stubbed)


def test_stubbed_class_members_exist_and_public_members_are_stubbed():
    for cls_name, names in _stub_members().items():
        obj = getattr(core, cls_name)
        if not isinstance(obj, type):
            continue
        public = {n for n in vars(obj) if not n.startswith("_")}
        declared = {n for n in names if not n.startswith("_")}
        assert declared == public, cls_name
