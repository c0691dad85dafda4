"""Tool calling in chat completions, as OpenAI and vLLM define it.

    plan = tool_plan(req.tools, req.tool_choice)   # InvalidRequestError for a bad one
    plan.guided                                     # the output's grammar (required / named), or None
    content, calls = plan.parse(text)               # the choice's message

tool_choice:
- "none" (or no tools): tools are not rendered and never called (the text is the answer);
- "auto" (OpenAI's default when tools are given): the tools go to the chat template and the
  model may call them in the Hermes format its template teaches (`<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`, Qwen2.5's / Hermes' / SmolLM's); those blocks become
  `tool_calls`, the rest is `content`;
- "required": the output is constrained (structured output) to a JSON array of one or more
  {"name": <a tool's name>, "parameters": <its parameters>} objects (vLLM's schema);
- {"type": "function", "function": {"name": N}}: constrained to N's parameters; the output is
  the call's arguments.
A choice with calls has finish_reason "tool_calls". A model whose chat template has no tool
support gets a 400 (the tools could not be shown to it). Streaming with tools is refused
(400) until tool-call deltas are streamed.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from folio.worker.errors import InvalidRequestError
from folio.worker.guided import GuidedSpec

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _call(name: str, arguments) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


@dataclass
class ToolPlan:
    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[dict] = field(default_factory=list)  # OpenAI's tool objects, as given
    name: str | None = None  # the named function
    guided: GuidedSpec | None = None

    @property
    def renders(self) -> bool:
        """Whether the tools go to the chat template."""
        return self.mode != "none"

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of one choice's text."""
        if self.mode == "named":
            return None, [_call(self.name, text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except ValueError:  # cut short by max_tokens: no call can be made of it
                return text, []
            return None, [_call(it["name"], it.get("parameters", {})) for it in items]
        if self.mode == "auto":
            calls, names = [], {t["function"]["name"] for t in self.tools}
            for m in _HERMES.finditer(text):
                try:
                    obj = json.loads(m.group(1))
                except ValueError:
                    continue
                if isinstance(obj, dict) and obj.get("name") in names:
                    calls.append((m.span(), _call(obj["name"], obj.get("arguments", {}))))
            if not calls:
                return text, []
            rest, at = [], 0
            for (a, b), _ in calls:
                rest.append(text[at:a])
                at = b
            rest.append(text[at:])
            content = "".join(rest).strip()
            return content or None, [c for _, c in calls]
        return text, []


def tool_plan(tools: list | None, tool_choice) -> ToolPlan:
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return ToolPlan("none", list(tools or []))
    if not tools:
        raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict) \
                or not isinstance(f.get("name"), str) or not f["name"] \
                or not isinstance(f.get("parameters", {}), dict):
            raise InvalidRequestError(f'tools.{i} must be {{"type": "function", "function": {{"name": ..., '
                                      f'"parameters": {{...}}}}}}', param="tools")
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    params = {n: f.get("parameters") or {"type": "object", "properties": {}} for n, f in by_name.items()}
    if tool_choice == "auto":
        return ToolPlan("auto", list(tools))
    if tool_choice == "required":
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"enum": [n]}, "parameters": p},
             "required": ["name", "parameters"], "additionalProperties": False} for n, p in params.items()]}}
        return ToolPlan("required", list(tools), guided=GuidedSpec("json_schema", json.dumps(schema)))
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in by_name:
            raise InvalidRequestError(f"tool_choice names {name!r}, which is not in tools", param="tool_choice")
        return ToolPlan("named", list(tools), name, GuidedSpec("json_schema", json.dumps(params[name])))
    raise InvalidRequestError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                              '{"name": ...}}', param="tool_choice")
