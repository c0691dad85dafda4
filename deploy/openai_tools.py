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
support gets a 400 (the tools could not be shown to it). Streamed, the same parser
(`ToolCallStream`) turns each piece of text into content and `tool_calls` deltas, so the
deltas of a stream add up to the message the same request gets unstreamed.
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

    def stream(self) -> "ToolCallStream":
        """An incremental parser for one choice's text (streamed or not)."""
        return ToolCallStream(self)

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of one choice's text: the stream parser fed the whole text, so a
        streamed choice adds up to the same message."""
        p = self.stream()
        c1, d1 = p.feed(text)
        c2, d2 = p.finish()
        calls = merge_deltas(d1 + d2)
        if not calls:
            return text, []
        return ((c1 + c2).strip() or None), calls


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


class ToolCallStream:
    """Splits a choice's text, piece by piece, into content and tool-call deltas (OpenAI's
    streaming shape: the first delta of a call has its index, id, type and name; later ones add
    to its arguments).

    - named: every piece is the call's arguments, streamed as it comes;
    - required: the JSON array is scanned (strings and escapes tracked); each element becomes a
      call the moment its object closes; nothing is content unless no call could be made (text
      cut short before the first element closed: then the text is the content);
    - auto: text outside Hermes `<tool_call>...</tool_call>` blocks is content, streamed at once
      except a tail that may be the start of a tag; a block becomes a call when it closes and
      holds {"name": <a tool's>, "arguments": ...}; any other block (and an unclosed one at the
      end) stays content, verbatim.
    """

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.calls = 0
        self._names = {t["function"]["name"] for t in plan.tools}
        self._buf = ""  # text not yet given out (auto: a possible tag or an open block)
        self._inside = False  # auto: inside a <tool_call> block
        self._text = ""  # required: all the text
        self._at = 0  # required: scanned up to here
        self._depth = 0
        self._in_str = self._esc = False
        self._elem = 0  # required: where the current element began

    def _call(self, name: str, arguments: str) -> dict:
        d = {"index": self.calls, **_call(name, arguments)}
        self.calls += 1
        return d

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(content, tool-call deltas) that this piece completes."""
        mode = self.plan.mode
        if mode == "named":
            if not self.calls:
                return "", [self._call(self.plan.name, text)]
            return "", [{"index": 0, "function": {"arguments": text}}] if text else []
        if mode == "required":
            return "", self._scan(text)
        if mode == "auto":
            return self._hermes(text)
        return text, []

    def finish(self) -> tuple[str, list[dict]]:
        """What the end of the text releases."""
        mode = self.plan.mode
        if mode == "named":
            return "", [] if self.calls else [self._call(self.plan.name, "")]
        if mode == "required":
            return ("" if self.calls else self._text), []
        if mode == "auto":
            rest = (_OPEN if self._inside else "") + self._buf
            self._buf, self._inside = "", False
            return rest, []
        return "", []

    def _scan(self, text: str) -> list[dict]:
        self._text += text
        out = []
        t = self._text
        for i in range(self._at, len(t)):
            ch = t[i]
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif ch == "\\":
                    self._esc = True
                elif ch == '"':
                    self._in_str = False
            elif ch == '"':
                self._in_str = True
            elif ch in "[{":
                self._depth += 1
                if self._depth == 2:
                    self._elem = i
            elif ch in "]}":
                self._depth -= 1
                if self._depth == 1 and ch == "}":
                    try:
                        item = json.loads(t[self._elem:i + 1])
                    except ValueError:
                        item = None
                    if isinstance(item, dict) and isinstance(item.get("name"), str):
                        out.append(self._call(item["name"], item.get("parameters", {})))
        self._at = len(t)
        return out

    def _hermes(self, text: str) -> tuple[str, list[dict]]:
        buf, content, out = self._buf + text, [], []
        while True:
            if not self._inside:
                i = buf.find(_OPEN)
                if i < 0:
                    keep = next((k for k in range(min(len(buf), len(_OPEN) - 1), 0, -1) if buf.endswith(_OPEN[:k])), 0)
                    content.append(buf[:len(buf) - keep])
                    buf = buf[len(buf) - keep:]
                    break
                content.append(buf[:i])
                buf, self._inside = buf[i + len(_OPEN):], True
            else:
                j = buf.find(_CLOSE)
                if j < 0:
                    break
                block, buf, self._inside = buf[:j], buf[j + len(_CLOSE):], False
                try:
                    obj = json.loads(block)
                except ValueError:
                    obj = None
                if isinstance(obj, dict) and obj.get("name") in self._names:
                    out.append(self._call(obj["name"], obj.get("arguments", {})))
                else:
                    content.append(_OPEN + block + _CLOSE)
        self._buf = buf
        return "".join(content), out


def merge_deltas(deltas: list[dict]) -> list[dict]:
    """The tool calls that a list of streamed deltas adds up to (as a client assembles them)."""
    calls: dict[int, dict] = {}
    for d in deltas:
        c = calls.get(d["index"])
        if c is None:
            calls[d["index"]] = {"id": d["id"], "type": d["type"], "function": dict(d["function"])}
        else:
            c["function"]["arguments"] += d["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]


def check_template_tools(tokenizer) -> None:
    """Tools are shown to the model by its chat template: one that never reads `tools` cannot."""
    if "tools" not in (getattr(tokenizer, "chat_template", None) or ""):
        raise InvalidRequestError("this model's chat template has no tool support: tools can only be given "
                                  'with tool_choice "none"', param="tools")


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
        return ToolPlan("required", list(tools), guided=GuidedSpec("json_schema", json.dumps(schema), "tools"))
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in by_name:
            raise InvalidRequestError(f"tool_choice names {name!r}, which is not in tools", param="tool_choice")
        return ToolPlan("named", list(tools), name, GuidedSpec("json_schema", json.dumps(params[name]), "tools"))
    raise InvalidRequestError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                              '{"name": ...}}', param="tool_choice")
