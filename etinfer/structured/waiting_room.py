"""Requests whose grammars are still compiling: held outside the scheduler until ready.

The engine hands each structured request here; one whose grammar is cached joins the
scheduler at once, the others join at the first step after their compilation ends, so a slow
schema delays its own request only and the step loop never waits on a compiler.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import TYPE_CHECKING

from etinfer.structured.backend import CompiledGrammar
from etinfer.structured.compiler import GrammarCompiler

if TYPE_CHECKING:
    from etinfer.engine.sequence import Sequence


class GrammarWaitingRoom:
    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._compiling: dict[str, tuple[Sequence, Future[CompiledGrammar]]] = {}

    def enter(self, seq: Sequence) -> bool:
        """Start ``seq``'s grammar; True when it must wait for it. A grammar already known to
        be invalid raises ValueError here, before the request is accepted."""
        future = self.compiler.submit(seq.params.structured)
        if future.done():
            seq.structured.matcher = future.result().matcher()  # raises the compile error, if any
            return False
        self._compiling[seq.request_id] = (seq, future)
        return True

    def leave(self) -> tuple[list[Sequence], list[Sequence]]:
        """The sequences whose grammars are ready (their matchers set) and those whose grammars
        failed (finished with reason "error")."""
        ready, failed = [], []
        for request_id, (seq, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            try:
                seq.structured.matcher = future.result().matcher()
                ready.append(seq)
            except ValueError as error:
                seq.finish_reason, seq.error = "error", str(error)
                failed.append(seq)
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Block until a compilation ends or ``timeout`` passes (a step with nothing else to
        run, instead of spinning)."""
        if self._compiling:
            wait([f for _, f in self._compiling.values()], timeout, FIRST_COMPLETED)

    def remove(self, request_id: str) -> Sequence | None:
        entry = self._compiling.pop(request_id, None)
        return None if entry is None else entry[0]

    def __len__(self) -> int:
        return len(self._compiling)
