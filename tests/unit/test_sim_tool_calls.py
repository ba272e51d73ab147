"""The sim's forced tool calls (infera/engine/sim/tool_calls.py): which tool, and the arguments'
JSON frame around the generated text."""
from __future__ import annotations

import json

import pytest

from infera.engine.sim.server import ApiError
from infera.engine.sim.tool_calls import argument_frame, forced_tool

F = {"type": "function", "function": {"name": "f", "parameters": {}}}
G = {"type": "function", "function": {"name": "g", "parameters": {}}}


@pytest.mark.parametrize("tools,choice,name", [
    ([F, G], "required", "f"),
    ([F, G], {"type": "function", "function": {"name": "g"}}, "g"),
    ([F, G], "auto", None),
    ([F, G], "none", None),
    ([F, G], None, None),
    (None, "required", None),
    ([], "required", None),
])
def test_forced_tool(tools, choice, name):
    got = forced_tool(tools, choice)
    assert (got["name"] if got else None) == name


def test_named_tool_not_in_tools_is_400():
    with pytest.raises(ApiError) as info:
        forced_tool([F], {"type": "function", "function": {"name": "nope"}})
    assert info.value.status == 400


@pytest.mark.parametrize("schema,text,expected", [
    ({}, "", {}),
    ({"type": "object", "properties": {}}, "", {}),
    ({"properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}}}, "", {"n": 0, "ok": False}),
    ({"properties": {"city": {"type": "string"}}}, ' Pa"ris\n', {"city": ' Pa"ris\n'}),
    ({"properties": {"a": {"type": "string"}, "n": {"type": "number"}, "b": {"type": "string"}}}, " x",
     {"a": "", "n": 0, "b": " x"}),
])
def test_argument_frame_is_valid_json(schema, text, expected):
    head, tail, takes_text = argument_frame(schema)
    inner = json.dumps(text)[1:-1] if takes_text else ""
    assert json.loads(head + inner + tail) == expected
