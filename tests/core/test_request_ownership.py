"""A request is complete when it is built, and only core/ changes it afterwards (issue 53, as vLLM v1): the
scheduler owns its progress, drafts arrive through Scheduler.update_draft_token_ids, beam groups return their
advance for the scheduler to apply, and everything else (priority, arrival time, grammar) goes into the
constructor. This scans pagedllm/ outside core/ for stores to a core Request's fields and calls of its mutating
methods, on names that hold requests: by convention (req, request, target, ...), annotated as Request or bound to
Request(...)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from pagedllm.core.request import Request

PACKAGE = Path(__file__).resolve().parents[2] / "pagedllm"
FIELDS = frozenset(f.name for f in dataclasses.fields(Request))
METHODS = frozenset(name for name, fn in inspect.getmembers(Request, inspect.isfunction)
                    if not name.startswith("_"))  # append_output_token: it mutates
LIST_MUTATORS = frozenset({"append", "extend", "insert", "clear", "pop", "remove", "sort", "reverse"})
# names (and attributes, as in `entry.request`) that hold a core Request by convention in this code base
REQUEST_NAMES = frozenset({"r", "req", "request", "seq", "beam", "target", "parent", "child", "root", "victim"})
_ANNOTATION = re.compile(r"\bRequest\b")  # Request, Request | None; not ScheduledRequest or RequestState


def _typed_request_names(tree: ast.AST) -> set[str]:
    """Names the module annotates as a Request or binds to a Request(...) call."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None:
            if _ANNOTATION.search(ast.unparse(node.annotation)):
                names.add(node.arg)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if _ANNOTATION.search(ast.unparse(node.annotation)):
                names.add(node.target.id)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            if isinstance(func, ast.Name) and func.id == "Request":
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _holds_request(node: ast.AST, names: set[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id in names
    return isinstance(node, ast.Attribute) and node.attr in REQUEST_NAMES


def _field_of(node: ast.AST, names: set[str]) -> ast.Attribute | None:
    """`node` if it is a Request field of a name holding a request (or a subscript of one)."""
    if isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and node.attr in FIELDS and _holds_request(node.value, names):
        return node
    return None


def violations(source: str, path: str) -> list[str]:
    """'path:line: code' for every change of a Request after it was built."""
    tree = ast.parse(source)
    names = REQUEST_NAMES | _typed_request_names(tree)
    found = []

    def flag(node: ast.AST) -> None:
        found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Delete):
            targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
            for target in targets:
                for sub in ast.walk(target):
                    if isinstance(getattr(sub, "ctx", None), ast.Store | ast.Del) and _field_of(sub, names):
                        flag(sub)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner, method = node.func.value, node.func.attr
            if (method in LIST_MUTATORS and _field_of(owner, names)) or (
                    method in METHODS and _holds_request(owner, names)):
                flag(node)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            if node.args and _holds_request(node.args[0], names):
                flag(node)
    return found


def test_no_request_field_is_assigned_outside_core():
    found, paths = [], sorted(PACKAGE.rglob("*.py"))
    assert paths, f"no package at {PACKAGE}"
    for path in paths:
        rel = path.relative_to(PACKAGE.parent)
        if rel.parts[1] != "core":
            found += violations(path.read_text(), str(rel))
    assert not found, ("a core Request is changed outside pagedllm/core/ (build it complete, or let the scheduler "
                       "change it; a name that is not a core Request: rename it):\n" + "\n".join(found))


@pytest.mark.parametrize("code", [
    # what the engine did before issue 53 (llm_engine, output_processor, speculative, draft_model)
    "req = self.output_processor.add_request(state, arrival_time)\nreq.priority = priority",
    "def f(req):\n    req.new_grammar = lambda: make(compiled)\n    req.grammar = req.new_grammar()",
    "def add(self, state):\n    req = Request('a', [1])\n    if t is not None:\n        req.arrival_time = t",
    "for req, k in wanted:\n    req.spec_token_ids = ngram_lookup(req.all_token_ids, 1, 2, k)",
    "for target, _ in wanted:\n    target.spec_token_ids = list(out) if done else []",
    # other ways to change one
    "def f(x: Request | None):\n    x.num_computed_tokens += 1",
    "s.request.status = RequestStatus.RUNNING",
    "req.output_token_ids.append(3)",
    "del req.spec_token_ids[2:]",
    "seq.append_output_token(7)",
    "setattr(request, 'priority', 1)",
    "a, req.seed = 1, 2",
])
def test_the_scan_catches_changes_to_a_request(code):
    assert len(violations(code, "x.py")) >= 1


@pytest.mark.parametrize("code", [
    "state.grammar = fut\nstate.error = 'x'\nsample.stop_reason = 3",  # a RequestState / SampleState
    "self.priority = 1\nself.eos_token_ids = set()",
    "def f(s: ScheduledRequest):\n    s.num_new_tokens = 1\n    s.draft_token_ids.append(3)",
    "req = Request('a', [1], priority=2, arrival_time=t)\nx = req.spec_token_ids",
    "scheduler.update_draft_token_ids({req.request_id: drafts})",
])
def test_the_scan_lets_other_objects_and_reads_be(code):
    assert violations(code, "x.py") == []
