"""The tool-call layer: neutral tool definitions (spec), parsing a model's output into calls
(parse, stream), grammars that force calls (grammar) and tools as prompt text (render).
Pure text: no engine, no HTTP. See each module's doc for the formats."""

from imp.tools.grammar import SHAPES, Shape, arguments_schema, call_grammar, close_objects, tools_grammar
from imp.tools.parse import (FORMATS, Format, Parsed, ToolCall, counter_ids, new_call_id, parse,
                             reprefix)
from imp.tools.render import call_message_text, result_text, tools_system_prompt
from imp.tools.spec import Tool, ToolChoice, ToolSpecError, from_anthropic, from_openai, from_responses
from imp.tools.stream import ArgsDelta, CallEnd, CallStart, Event, Text, ToolStreamParser, collect, stream_parser

__all__ = [
    "SHAPES", "Shape", "arguments_schema", "call_grammar", "close_objects", "tools_grammar",
    "FORMATS", "Format", "Parsed", "ToolCall", "counter_ids", "new_call_id", "parse", "reprefix",
    "call_message_text", "result_text", "tools_system_prompt",
    "Tool", "ToolChoice", "ToolSpecError", "from_anthropic", "from_openai", "from_responses",
    "ArgsDelta", "CallEnd", "CallStart", "Event", "Text", "ToolStreamParser", "collect", "stream_parser",
]
