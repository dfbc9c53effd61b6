"""A small, safe arithmetic evaluator for the calculator env: no eval(), bounded work.

Grammar (whitespace ignored):
    expr   := term (("+" | "-") term)*
    term   := factor (("*" | "/") factor)*
    factor := ("+" | "-") factor | number | "(" expr ")"
    number := digits ["." digits]

Values are exact `Fraction`s. What a policy writes is untrusted, so every dimension of the work
is bounded: expression length, digits per number, nesting depth and the size of every
intermediate value. A violation raises `CalcError` whose `reason` is a short lower-case phrase
(it becomes the tool's answer, so it uses only characters the tiny char tokenizer knows).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

MAX_EXPRESSION_CHARS = 64
MAX_NUMBER_DIGITS = 12
MAX_ABS_VALUE = 10**15
MAX_DEPTH = 16
DECIMALS = 6
"""Non-integer results are shown rounded to this many decimal places."""


class CalcError(ValueError):
    """An expression the calculator refuses; `reason` is what the tool answers."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True)
class Limits:
    max_chars: int = MAX_EXPRESSION_CHARS
    max_digits: int = MAX_NUMBER_DIGITS
    max_abs: int = MAX_ABS_VALUE
    max_depth: int = MAX_DEPTH


def evaluate(expression: str, limits: Limits | None = None) -> Fraction:
    """The exact value of `expression`; CalcError for anything malformed or out of bounds."""
    limits = limits or Limits()
    text = expression.replace(" ", "")
    if not text:
        raise CalcError("empty expression")
    if len(text) > limits.max_chars:
        raise CalcError("expression too long", f"{len(text)} > {limits.max_chars} characters")
    return _Parser(text, limits).parse()


def format_number(value: Fraction) -> str:
    """'5535' for integers, else the value rounded to DECIMALS places without trailing zeros."""
    if value.denominator == 1:
        return str(value.numerator)
    scaled = round(value * 10**DECIMALS)
    sign = "-" if scaled < 0 else ""
    whole, frac = divmod(abs(scaled), 10**DECIMALS)
    digits = f"{frac:0{DECIMALS}d}".rstrip("0")
    return f"{sign}{whole}.{digits}" if digits else f"{sign}{whole}"


class _Parser:
    def __init__(self, text: str, limits: Limits) -> None:
        self.text, self.limits, self.pos, self.depth = text, limits, 0, 0

    def parse(self) -> Fraction:
        value = self._expr()
        if self.pos != len(self.text):
            raise CalcError("bad expression", f"unexpected {self.text[self.pos]!r} at {self.pos}")
        return value

    def _peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def _checked(self, value: Fraction) -> Fraction:
        # Bounding every intermediate value (and its denominator) keeps each operation cheap.
        if abs(value) > self.limits.max_abs or value.denominator > self.limits.max_abs:
            raise CalcError("number too large", f"beyond {self.limits.max_abs}")
        return value

    def _expr(self) -> Fraction:
        value = self._term()
        while self._peek() in ("+", "-"):
            op = self.text[self.pos]
            self.pos += 1
            rhs = self._term()
            value = self._checked(value + rhs if op == "+" else value - rhs)
        return value

    def _term(self) -> Fraction:
        value = self._factor()
        while self._peek() in ("*", "/"):
            op = self.text[self.pos]
            self.pos += 1
            rhs = self._factor()
            if op == "/" and rhs == 0:
                raise CalcError("division by zero")
            value = self._checked(value * rhs if op == "*" else value / rhs)
        return value

    def _factor(self) -> Fraction:
        self.depth += 1
        if self.depth > self.limits.max_depth:
            raise CalcError("expression too deep", f"more than {self.limits.max_depth} levels")
        try:
            ch = self._peek()
            if ch in ("+", "-"):
                self.pos += 1
                inner = self._factor()
                return inner if ch == "+" else -inner
            if ch == "(":
                self.pos += 1
                value = self._expr()
                if self._peek() != ")":
                    raise CalcError("bad expression", f"missing ')' at {self.pos}")
                self.pos += 1
                return value
            return self._number()
        finally:
            self.depth -= 1

    def _number(self) -> Fraction:
        start = self.pos
        while self._peek().isdigit() or self._peek() == ".":
            self.pos += 1
        token = self.text[start : self.pos]
        if not token:
            found = repr(self._peek()) if self._peek() else "the end"
            raise CalcError("bad expression", f"expected a number at {start}, found {found}")
        whole, dot, frac = token.partition(".")
        if not whole or "." in frac or (dot and not frac):
            raise CalcError("bad expression", f"malformed number {token!r}")
        if not (whole + frac).isascii():  # str.isdigit accepts non-ASCII digits such as '²'
            raise CalcError("bad expression", f"malformed number {token!r}")
        if len(whole) + len(frac) > self.limits.max_digits:
            raise CalcError(
                "number too large", f"{token!r} has over {self.limits.max_digits} digits"
            )
        return self._checked(Fraction(token))
