"""Pick an implementation of a seam by name, with an error that lists the names known."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[..., T]] = {}

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        def add(factory: Callable[..., T]) -> Callable[..., T]:
            self._factories[name] = factory
            return factory

        return add

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._factories)

    def check(self, name: str) -> str:
        if name not in self._factories:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names)}")
        return name

    def create(self, name: str, **kwargs) -> T:
        return self._factories[self.check(name)](**kwargs)
