"""OpenAI's Responses API (``POST /v1/responses``) over the chat path. A request is read into a
chat completion request (``to_chat``: ``input`` items become messages, ``instructions`` a system
message, flat function tools chat tools, ``text.format`` a response format), which the server checks
and runs as any chat request; ``Writer`` turns its events into the response's output items
(reasoning, message, function calls) and, streamed, into the typed events that build them. Nothing
is stored but the output items of recent answers (``ItemStore``, in memory and bounded), so that a
client may refer to them by id (``item_reference``) in the next turn; a conversation otherwise
goes back in whole, as with chat completions."""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections import OrderedDict

from . import tools as tool_calls


class RequestError(ValueError):
    """A request the Responses API reading cannot take (the server answers 400 naming ``param``)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


NOT_STORED = "responses are not stored here; send the whole conversation in input"
REFUSED = {"previous_response_id": NOT_STORED, "conversation": NOT_STORED,
           "prompt": "stored prompts are not supported; send the instructions and input",
           "background": "background responses are not supported"}
# OpenAI's reasoning efforts (a model's thinking is on or off: "none" is off, the others on)
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
# what the Responses API names otherwise or means differently: never passed to the chat reading as is
OWN = {"input", "instructions", "max_output_tokens", "tools", "tool_choice", "text", "reasoning", "include",
       "top_logprobs", "stream_options", "store", "metadata", "truncation", "max_tool_calls", "prompt_cache_key",
       "safety_identifier", "service_tier", "user", *REFUSED}


class ItemStore:
    """The output items of recent answers by id, newest kept (at most ``items`` of them and ``size``
    bytes of JSON): clients such as the AI SDK send an earlier answer back as ``item_reference``s
    to its items' ids (the Responses API stores by default). Lost on restart, and not shared between
    servers: a reference the store does not hold is a 400 saying to send the item itself."""

    def __init__(self, items: int = 4096, size: int = 32 << 20):
        self.limit, self.size = items, size
        self.held: OrderedDict = OrderedDict()
        self.bytes = 0
        self.lock = threading.Lock()

    def keep(self, items: list) -> None:
        with self.lock:
            for it in items:
                n = len(json.dumps(it))
                if n > self.size:
                    continue
                old = self.held.pop(it["id"], None)
                if old is not None:
                    self.bytes -= old[1]
                self.held[it["id"]] = (dict(it), n)
                self.bytes += n
            while self.held and (len(self.held) > self.limit or self.bytes > self.size):
                self.bytes -= self.held.popitem(last=False)[1][1]

    def get(self, item_id):
        with self.lock:
            found = self.held.get(item_id) if isinstance(item_id, str) else None
            return None if found is None else dict(found[0])


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def to_chat(req: dict, items: ItemStore | None = None) -> tuple[dict, list]:
    """(the request as a chat completion request, where each of its messages came from: "input[i]"
    or "instructions"). The sampling fields and edgevl's extensions (``top_k``, ``seed``, ``stop``,
    ``chat_template_kwargs``, ``video_options``...) pass through. ``items``: where
    ``item_reference`` items are looked up."""
    if not isinstance(req, dict):
        raise RequestError("the request must be a JSON object")
    for key, why in REFUSED.items():
        if req.get(key):
            raise RequestError(f"{key}: {why}", key)
    chat = {k: v for k, v in req.items() if k not in OWN}
    messages, origin = [], []
    instructions = req.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise RequestError("instructions must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
        origin.append("instructions")
    given = req.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
        origin.append("input")
    elif isinstance(given, list) and given:
        messages += _items(given, origin, items)
    else:
        raise RequestError("input must be a string or a non-empty list of items", "input")
    chat["messages"] = messages
    reasoning = req.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise RequestError("reasoning must be an object, e.g. {\"effort\": \"none\"}", "reasoning")
    if (reasoning or {}).get("effort") is not None:
        if reasoning["effort"] not in EFFORTS:
            raise RequestError(f"reasoning.effort must be one of {', '.join(EFFORTS)}, got {reasoning['effort']!r:.40}",
                               "reasoning.effort")
        chat["reasoning_effort"] = reasoning["effort"]
    include = req.get("include") or []
    if isinstance(include, list) and "message.output_text.logprobs" in include:
        chat["logprobs"] = True
        chat["top_logprobs"] = req.get("top_logprobs") or 0
    if req.get("max_output_tokens") is not None:
        chat["max_tokens"] = req["max_output_tokens"]
    if req.get("tools") is not None:
        chat["tools"] = _tools(req["tools"])
    choice = req.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    elif isinstance(choice, dict) and choice.get("type") != "function":
        raise RequestError(f"tool_choice of type {choice.get('type')!r} is not supported: use auto, none, required "
                           "or {\"type\": \"function\", \"name\": ...}", "tool_choice")
    if choice is not None:
        chat["tool_choice"] = choice
    text = req.get("text")
    if text is not None:
        if not isinstance(text, dict):
            raise RequestError("text must be an object such as {\"format\": {\"type\": \"json_schema\", ...}}", "text")
        fmt = text.get("format")
        if fmt is not None:
            chat["response_format"] = _format(fmt)
    return chat, origin


# the chat reading's field names, as a Responses request spells them
FIELDS = ((r"^messages$", "input"), (r"\bmax_tokens\b", "max_output_tokens"),
          (r"\bresponse_format(\.json_schema)?", "text.format"), (r"\b(tools\[\d+\])\.function\.", r"\1."),
          (r"\btool_choice\.function\.", "tool_choice."), (r"\btool_call_id\b", "call_id"),
          (r"\btool result\b", "function_call_output"), (r'a role "tool" message', "a function_call_output item"))


def renamed(text: str, origin: list) -> str:
    """A chat reading's ``messages[k]`` in ``text`` named as the request named it (``input[i]``),
    and its other fields (``FIELDS``)."""
    # (not inside a path a message quotes: a folder may be named messages[0])
    text = re.sub(r"(?<![\w/.-])messages\[(\d+)\](?![\w/])",
                  lambda m: origin[int(m[1])] if int(m[1]) < len(origin) else m[0], text)
    for chat, ours in FIELDS:
        text = re.sub(chat, ours, text)
    return text


def _format(fmt) -> dict:
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise RequestError("text.format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": "
                           "\"json_schema\", \"name\", \"schema\", \"strict\"}", "text.format")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": inner}


def _tools(tools) -> list:
    if not isinstance(tools, list):
        raise RequestError("tools must be a list of function tools", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise RequestError(f"tools[{i}] is a {kind!r} tool; only function tools are supported (built-in tools "
                               "such as web_search run on OpenAI's side)", f"tools[{i}]")
        out.append(t if "function" in t else
                   {"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                                     if k in t}})
    return out


def _items(items: list, origin: list, store: ItemStore | None = None) -> list:
    out, dropped, thought = [], set(), {}
    for i, it in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(it, dict):
            raise RequestError(f"{where} must be an object (a message, function_call or function_call_output item)",
                               where)
        kind = it.get("type", "message")
        if kind == "item_reference":
            if not isinstance(it.get("id"), str) or not it["id"]:
                raise RequestError(f"{where} needs the id of the item it refers to", f"{where}.id")
            found = store.get(it.get("id")) if store is not None else None
            if found is None:
                raise RequestError(f"{where} refers to the item {it.get('id')!r:.60}, which this server does not "
                                   "hold (it keeps recent answers' items in memory only); send the item itself "
                                   "(in the AI SDK: providerOptions.openai.store = false)", where)
            it, kind = found, found["type"]
        if kind == "function_call":
            args = it.get("arguments", "{}")
            if isinstance(args, dict):    # an object where OpenAI's API has its JSON text
                it = {**it, "arguments": json.dumps(args)}
            elif not isinstance(args, str):
                raise RequestError(f"{where}.arguments must be the call's arguments as a JSON object's text",
                                   f"{where}.arguments")
            else:
                try:
                    parsed = json.loads(args) if args.strip() else {}
                except ValueError:
                    if it.get("status") == "incomplete":   # a call the token limit cut: no call was made
                        dropped.add(it.get("call_id"))
                        continue
                    raise RequestError(f"{where}.arguments is not JSON ({args!r:.60}); send the arguments the call "
                                       "returned", f"{where}.arguments") from None
                if not isinstance(parsed, dict):
                    raise RequestError(f"{where}.arguments must be a JSON object, got {args!r:.40}",
                                       f"{where}.arguments")
        if kind == "function_call_output" and it.get("call_id") in dropped:
            continue
        if kind == "message":
            content = it.get("content")
            if isinstance(content, list):
                content = [_part(p, f"{where}.content[{j}]") for j, p in enumerate(content)]
            out.append({"role": it.get("role"), "content": content, **(thought if it.get("role") == "assistant"
                                                                       else {})})
            origin.append(where)
            thought = {}
        elif kind == "function_call":
            if not isinstance(it.get("call_id"), str) or not it["call_id"]:
                raise RequestError(f"{where} needs its call_id, which the function_call_output answering it names",
                                   f"{where}.call_id")
            call = {"id": it.get("call_id"), "type": "function",
                    "function": {"name": it.get("name"), "arguments": it.get("arguments", "{}")}}
            if out and out[-1].get("role") == "assistant":    # the turn's text, then its calls
                out[-1].setdefault("tool_calls", []).append(call)
                for k, v in thought.items():    # the turn's own reasoning, if it had one, stays
                    out[-1].setdefault(k, v)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call], **thought})
                origin.append(where)
            thought = {}
        elif kind == "function_call_output":
            output = it.get("output")
            if isinstance(output, list):    # parts: a tool may return an image (a screenshot, a camera's frame)
                output = [_part(p, f"{where}.output[{j}]") for j, p in enumerate(output)]
                for j, p in enumerate(output):    # named here: the chat reading would name a content part
                    field = p["type"] if p["type"] in ("text", "image_url") else None
                    value = p.get(field) if field else ""
                    if not isinstance(value.get("url") if isinstance(value, dict) else value, str):
                        raise RequestError(f"{where}.output[{j}] needs its {field} as a string", f"{where}.output[{j}]")
                if all(p["type"] == "text" and isinstance(p["text"], str) for p in output):
                    output = "".join(p["text"] for p in output)
            if not isinstance(output, (str, list)):
                raise RequestError(f"{where}.output must be a string or a list of input_text and input_image parts",
                                   f"{where}.output")
            out.append({"role": "tool", "tool_call_id": it.get("call_id"), "content": output})
            origin.append(where)
            thought = {}
        elif kind == "reasoning":
            # the thinking of the assistant turn after it: templates that think keep it for the turns
            # after the last user message (a tool loop's) or drop it, as they were trained
            text = "".join(p.get("text", "") for p in it.get("content") or () if isinstance(p, dict)
                           and p.get("type") == "reasoning_text" and isinstance(p.get("text"), str))
            thought = {"reasoning_content": text} if text else {}
            continue
        else:
            raise RequestError(f"{where} is a {kind!r} item; message, function_call, function_call_output and "
                               "reasoning items are supported", where)
    return out


def _part(p, where: str) -> dict:
    kind = p.get("type") if isinstance(p, dict) else None
    if kind in ("input_text", "output_text", "text"):
        return {"type": "text", "text": p.get("text")}
    if kind == "refusal":
        return {"type": "text", "text": p.get("refusal")}
    if kind == "input_image":
        if p.get("file_id"):
            raise RequestError(f"{where}: file ids are not supported; send the image as a data: URL", where)
        url = p.get("image_url")
        return {"type": "image_url", "image_url": {"url": url.get("url") if isinstance(url, dict) else url}}
    if kind in ("image_url", "video_url"):     # the chat API's own parts, and edgevl's video part
        return p
    raise RequestError(f"{where} must be an input_text or input_image part, or a video_url part for a video (files "
                       "and audio are not supported)", where)


class Writer:
    """A response's output items built from the chat path's events, with the typed stream events
    that build them (``start``, ``feed``, ``finish``; each returns the events to send)."""

    def __init__(self, req: dict, model_id: str, spec=None, store: ItemStore | None = None):
        self.id = _id("resp")
        self.req, self.model_id = req, model_id
        # where the finished answer's items are kept (none when the request says store: false)
        self.store = store if req.get("store") is not False else None
        self.calls = tool_calls.CallStream(spec) if spec is not None and spec.parses else None
        self.items: list[dict] = []
        self.open: dict | None = None     # the item being written
        self.text = ""                    # its text (reasoning or message) so far
        self.logprobs: list = []          # the message's tokens' log-probabilities so far (include asks)
        self.pending: list = []           # ... of tokens whose text has not been written yet
        self.blank = ""                   # blank text outside a message: its start if text follows
        self.seq = 0
        self.created = int(time.time())

    def response(self, status: str = "in_progress", last=None) -> dict:
        req = self.req
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
               "incomplete_details": None, "instructions": req.get("instructions"),
               "max_output_tokens": req.get("max_output_tokens"), "model": self.model_id,
               "output": [dict(i) for i in self.items] if status != "in_progress" else [],
               "parallel_tool_calls": req.get("parallel_tool_calls", True),
               "temperature": req.get("temperature"), "top_p": req.get("top_p"),
               "tool_choice": req.get("tool_choice", "auto"), "tools": req.get("tools") or [],
               "text": req.get("text") or {"format": {"type": "text"}}, "reasoning": req.get("reasoning"),
               "store": req.get("store") is not False, "metadata": req.get("metadata") or {},
               "truncation": "disabled", "usage": None}
        if status == "incomplete":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        if last is not None:
            out["usage"] = {"input_tokens": last.prompt_tokens,
                            # what the prompt reused, and what it computed, which its slot keeps for the next
                            "input_tokens_details": {"cached_tokens": last.prompt_tokens - last.prefill_tokens,
                                                     "cache_write_tokens": last.prefill_tokens},
                            "output_tokens": last.generation_tokens,
                            "output_tokens_details": {"reasoning_tokens": last.reasoning_tokens},
                            "total_tokens": last.prompt_tokens + last.generation_tokens}
        return out

    def _ev(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def start(self) -> list[dict]:
        r = self.response()
        return [self._ev("response.created", response=r), self._ev("response.in_progress", response=r)]

    def _begin(self, item: dict) -> list[dict]:
        out = self._close()
        self.open, self.text, self.logprobs = item, "", []
        self.items.append(item)
        i = len(self.items) - 1
        out.append(self._ev("response.output_item.added", output_index=i, item=dict(item)))
        # the text's part is announced before its deltas (clients' accumulators add the deltas to it)
        if item["type"] == "message":
            out.append(self._ev("response.content_part.added", item_id=item["id"], output_index=i, content_index=0,
                                part={"type": "output_text", "text": "", "annotations": []}))
        elif item["type"] == "reasoning":
            out.append(self._ev("response.content_part.added", item_id=item["id"], output_index=i, content_index=0,
                                part={"type": "reasoning_text", "text": ""}))
        return out

    def _close(self, complete: bool = True) -> list[dict]:
        item, i = self.open, len(self.items) - 1
        if item is None:
            return []
        self.open = None
        item["status"] = "completed" if complete else "incomplete"
        kind, where = item["type"], {"item_id": item["id"], "output_index": i}
        out = []
        if kind == "reasoning":
            part = {"type": "reasoning_text", "text": self.text}
            item["content"] = [part]
            out += [self._ev("response.reasoning_text.done", **where, content_index=0, text=self.text),
                    self._ev("response.content_part.done", **where, content_index=0, part=dict(part))]
        elif kind == "message":
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": self.logprobs}
            item["content"] = [part]
            out += [self._ev("response.output_text.done", **where, content_index=0, text=self.text,
                             logprobs=self.logprobs),
                    self._ev("response.content_part.done", **where, content_index=0, part=part)]
        else:
            out.append(self._ev("response.function_call_arguments.done", **where, name=item["name"],
                                arguments=item["arguments"]))
        out.append(self._ev("response.output_item.done", output_index=i, item=dict(item)))
        return out

    def _write(self, kind: str, text: str) -> list[dict]:
        out = []
        if self.open is None or self.open["type"] != kind:
            item = ({"id": _id("rs"), "type": "reasoning", "summary": [], "content": []} if kind == "reasoning"
                    else {"id": _id("msg"), "type": "message", "role": "assistant", "content": []})
            out += self._begin({**item, "status": "in_progress"})
        self.text += text
        where = {"item_id": self.open["id"], "output_index": len(self.items) - 1, "content_index": 0}
        if kind == "reasoning":
            out.append(self._ev("response.reasoning_text.delta", **where, delta=text))
        else:
            lp, self.pending = self.pending, []
            self.logprobs += lp
            out.append(self._ev("response.output_text.delta", **where, delta=text, logprobs=lp))
        return out

    def feed(self, ev) -> list[dict]:
        """The events one chat event (``generate.Event``) makes."""
        out = self._write("reasoning", ev.reasoning) if ev.reasoning else []
        self.pending += ev.logprobs
        end = ev.finish_reason is not None
        if self.calls is None:
            return out + (self._write("message", ev.text) if ev.text else [])
        for e in self.calls.feed(ev.text, end):
            if e[0] == "content":
                # blank text between calls (or before the first) is no message of its own; before
                # text it is the message's start
                if e[1].strip() or (self.open is not None and self.open["type"] == "message"):
                    out += self._write("message", self.blank + e[1])
                    self.blank = ""
                else:
                    self.blank += e[1]
            elif e[0] == "name":
                self.pending, self.blank = [], ""     # a call's tokens: no text of a message
                out += self._begin({"id": _id("fc"), "type": "function_call", "status": "in_progress",
                                    "call_id": e[2], "name": e[3], "arguments": ""})
            else:
                self.open["arguments"] += e[2]
                out.append(self._ev("response.function_call_arguments.delta", item_id=self.open["id"],
                                    output_index=len(self.items) - 1, delta=e[2]))
        return out

    def finish(self, last) -> list[dict]:
        """The last events, ``last`` the chat path's final event: the open item closed (incomplete
        where the token limit cut it, as OpenAI marks it), then the whole response."""
        # a call is written only once it closed: the limit never cuts one that was written
        whole = self.open is not None and self.open["type"] == "function_call"
        out = self._close(complete=whole or last.finish_reason != "length")
        status = "incomplete" if last.finish_reason == "length" else "completed"
        self.final = self.response(status, last)
        if self.store is not None:
            self.store.keep(self.items)
        return out + [self._ev("response.completed" if status == "completed" else "response.incomplete",
                               response=self.final)]
