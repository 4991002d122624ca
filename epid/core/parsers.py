"""How an ``EPID_*`` value is read: each parser turns the variable's text into a value or raises
ValueError, and states the form it expects (``expected``) for the one-line error
``epid.config.load`` shows."""

from __future__ import annotations

import math
from typing import Any

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


class Integer:
    """An integer, at least ``minimum`` when given."""

    def __init__(self, minimum: int | None = None) -> None:
        self.minimum = minimum
        self.expected = "an integer" if minimum is None else f"an integer >= {minimum}"

    def __call__(self, text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise ValueError("not an integer") from None
        if self.minimum is not None and value < self.minimum:
            raise ValueError
        return value


class Real:
    """A finite number, at least ``minimum`` (above it when ``above``) and at most ``maximum`` when given."""

    def __init__(self, minimum: float = 0.0, above: bool = False, maximum: float | None = None) -> None:
        self.minimum, self.above, self.maximum = minimum, above, maximum
        self.expected = f"a number {'>' if above else '>='} {minimum:g}"
        if maximum is not None:
            self.expected = f"a number in {minimum:g}..{maximum:g}"

    def __call__(self, text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            raise ValueError("not a number") from None
        if not math.isfinite(value) or value < self.minimum or (self.above and value <= self.minimum):
            raise ValueError
        if self.maximum is not None and value > self.maximum:
            raise ValueError
        return value


class Choice:
    """One of ``words``, in any case."""

    def __init__(self, *words: str, expected: str | None = None) -> None:
        self.words = words
        self.expected = expected or f"{', '.join(words[:-1])} or {words[-1]}"

    def __call__(self, text: str) -> Any:
        word = text.strip().lower()
        if not self.accepts(word):
            raise ValueError
        return self.value(word)

    def accepts(self, word: str) -> bool:
        return word in self.words

    def value(self, word: str) -> Any:
        return word


class Boolean(Choice):
    """1/0, true/false, yes/no or on/off, in any case."""

    def __init__(self) -> None:
        super().__init__(*TRUE_WORDS, *FALSE_WORDS, expected="1/0, true/false or yes/no")

    def value(self, word: str) -> bool:
        return word in TRUE_WORDS


class Device(Choice):
    """auto, cpu, cuda or cuda:N (whether the device exists is checked before the launch)."""

    def __init__(self) -> None:
        super().__init__("auto", "cpu", "cuda", expected="auto, cpu, cuda or cuda:N")

    def accepts(self, word: str) -> bool:
        return super().accepts(word) or (word.startswith("cuda:") and word[5:].isdigit())


class Text:
    """Any text, stripped; ``check`` (which raises ValueError) validates it when given."""

    def __init__(self, expected: str, check: Any = None) -> None:
        self.expected, self.check = expected, check

    def __call__(self, text: str) -> str:
        if self.check is not None:
            self.check(text)
        return text.strip()


Parser = Integer | Real | Choice | Text
