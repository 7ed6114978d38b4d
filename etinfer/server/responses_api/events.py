"""A streamed response's events, built from the chat path's streamed choice deltas.

OpenAI's order: ``response.created`` and ``response.in_progress``; per output item
``output_item.added``, its content (a message's ``content_part.added``, ``output_text.delta``s,
``output_text.done``, ``content_part.done``; a call's ``function_call_arguments.delta``s and
``.done``), ``output_item.done``; then ``response.completed`` (or ``response.incomplete``) with
the whole response, whose items are the ones streamed, ids and all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from etinfer.server.responses_api.translate import (
    function_call_item,
    message_item,
    new_id,
    output_text,
)


@dataclass
class _OpenItem:
    item: dict  # as announced by output_item.added
    index: int  # its output_index
    text: str = ""  # a message's text, or a call's arguments so far


@dataclass
class ResponseEvents:
    """One streamed response: ``response`` is its body so far (status, output, usage)."""

    response: dict
    sequence: int = 0
    items: list[dict] = field(default_factory=list)  # the finished ones, in order
    _open: _OpenItem | None = None

    def start(self) -> list[dict]:
        return [
            self._event("response.created", response=dict(self.response)),
            self._event("response.in_progress", response=dict(self.response)),
        ]

    def delta(self, fields: dict) -> list[dict]:
        """Events for one chat chunk's ``delta`` (``content``, ``tool_calls``)."""
        events = []
        if fields.get("content"):
            if self._open is None or self._open.item["type"] != "message":
                events += self._close()
                events += self._add(message_item("", new_id("msg"), "in_progress"))
                events.append(self._at("response.content_part.added", part=output_text("")))
            events.append(self._text_delta(fields["content"]))
        for call in fields.get("tool_calls") or []:
            if "id" in call:  # a new call; without id, more of the open call's arguments
                events += self._close()
                item = function_call_item(call, new_id("fc"), "", "in_progress")
                events += self._add(item)
            piece = call["function"].get("arguments", "")
            if piece:
                self._open.text += piece
                events.append(self._at("response.function_call_arguments.delta", delta=piece))
        return events

    def finish(self, ending: dict) -> list[dict]:
        """The open item closed, then the whole response with ``ending`` (its status, usage
        and telemetry)."""
        events = self._close()
        self.response.update(ending, output=self.items)
        kind = "response.completed" if ending["status"] == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=self.response)]

    def error(self, code: str, message: str) -> dict:
        return self._event("error", code=code, message=message, param=None)

    # -- items ----------------------------------------------------------------------------

    def _add(self, item: dict) -> list[dict]:
        self._open = _OpenItem(item, len(self.items))
        return [self._event("response.output_item.added", output_index=self._open.index, item=item)]

    def _text_delta(self, piece: str) -> dict:
        self._open.text += piece
        return self._at("response.output_text.delta", delta=piece, logprobs=[])

    def _close(self) -> list[dict]:
        current, self._open = self._open, None
        if current is None:
            return []
        item, text = current.item, current.text
        if item["type"] == "message":
            done = message_item(text, item["id"])
            events = [
                self._at("response.output_text.done", current, text=text, logprobs=[]),
                self._at("response.content_part.done", current, part=output_text(text)),
            ]
        else:
            done = {**item, "arguments": text, "status": "completed"}
            events = [
                self._at(
                    "response.function_call_arguments.done",
                    current,
                    arguments=text,
                    name=item["name"],
                )
            ]
        self.items.append(done)
        event = self._event("response.output_item.done", output_index=current.index, item=done)
        return [*events, event]

    def _at(self, kind: str, item: _OpenItem | None = None, **fields) -> dict:
        """An event about the open item (or ``item``): its id and place."""
        item = item or self._open
        where = {"item_id": item.item["id"], "output_index": item.index}
        if item.item["type"] == "message":
            where["content_index"] = 0
        return self._event(kind, **where, **fields)

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event
