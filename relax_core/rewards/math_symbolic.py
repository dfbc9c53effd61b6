r"""Reading a final answer written in LaTeX (or plain text) as a number, or as a tuple, interval or
set of numbers, without sympy: how the "math" reward (relax_core.rewards.math, which also holds
the comparison rules) reads answers such as `\frac{1}{2}`, `\sqrt[3]{27}`, `1.5\times10^{3}`,
`1e3`, `12\text{ cm}`, `\left(1,2\right)` or `[0, 1)`.

What it reads: `\frac` (`\dfrac`, `\tfrac`, `\frac12`), `\sqrt`, `\sqrt[n]{}`, `^`, `\cdot`,
`\times`, `\div`, `/`, `\binom`, `\pi`, `\infty`, signs, brackets, implicit products such as
`2\pi` or `3\sqrt{2}`, mixed numbers (`2\frac{1}{2}` is 2.5), scientific notation, thousands
separators (`1,234`, `1{,}234`, `1\,234`), `x = 5` (the right-hand side), a trailing percent
sign, and units that are not part of the value (`\text{}` or `\mathrm{}` holding words,
`^\circ`, `\$`). Rational arithmetic is exact (`\frac{4}{2}` is the integer 2); anything with
`\pi`, an irrational root or a non-integer power is a float. Text it cannot read entirely
(variables, `\log`, words, "1 000") is unreadable, never guessed at; a value that is undefined
(`\frac{1}{0}`) or too large to compute (`10^{10^{10}}`) reads as NaN, which equals nothing.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction

Value = Fraction | float

# Longer text is not an answer worth reading here; it also bounds the work per response.
MAX_CHARS = 500
# An exact power whose result would exceed this many bits is not computed (10^{10^{10}}).
_MAX_BITS = 1 << 15
_MAX_EXPONENT_DIGITS = 3

_TOKEN = re.compile(
    r"\s*(?:((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+(?![\w.]))?)|(\\[A-Za-z]+|\\.)|(\S))"
)
TEXT_GROUP = re.compile(
    r"\\(?:text|textrm|textbf|textit|textnormal|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}"
)
_NUMBERISH = re.compile(r"[\d.,\s+-]+")
_DELIMITER = re.compile(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|big|Big)(?![A-Za-z])\s*")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\circ\b|\\degree\b|\u00b0")
# A separator between digit groups of three: "1{,}000", "1\,000", "1\ 000", "1~000".
_GROUP_SEP = re.compile(r"(?<=\d)(?:\{,\}|\\,|\\ |\\;|~)(?=\d{3}(?!\d))")
_SPACE = re.compile(r"\\[,;:! ]|\\q?quad\b|~")
_GROUPED = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_OPENERS = {"(": ")", "[": "]", "{": "}", "\\{": "\\}"}
_CLOSERS = {")", "]", "}", "\\}"}
RELATIONS = {"=", "\\approx"}
_UNICODE = {"\u2212": "-", "\u00d7": "\\times ", "\u00b7": "\\cdot ", "\u03c0": "\\pi "}


@dataclass(frozen=True)
class Scalar:
    value: Value
    percent: bool = False
    """Written with a trailing percent sign (see the module docstring for what it equals)."""


@dataclass(frozen=True)
class Group:
    """A tuple or interval (ordered; `opener`/`closer` are its brackets) or a set or bare list
    (unordered; opener "{")."""

    opener: str
    closer: str
    items: tuple[Scalar, ...]


Answer = Scalar | Group


class _Unreadable(Exception):
    pass


class _NoValue(Exception):
    """Well-formed, but with no value to compare: too large to compute, or undefined (division by
    zero, an even root of a negative number)."""


def _iroot(k: int, n: int) -> int | None:
    """The integer n-th root of k >= 0 if k is a perfect n-th power, else None."""
    if n == 2:
        r = math.isqrt(k)
        return r if r * r == k else None
    if k < 2:
        return k
    guess = round(math.exp(math.log(k) / n))
    return next((c for c in (guess - 1, guess, guess + 1) if c >= 0 and c**n == k), None)


def _float(v: Value) -> float:
    try:
        return float(v)
    except OverflowError as e:
        raise _NoValue from e


def _root(x: Value, n: Value) -> Value:
    if not (isinstance(n, Fraction) and n.denominator == 1 and n > 0):
        raise _Unreadable
    deg = int(n)
    sign = -1 if x < 0 else 1
    if x < 0 and deg % 2 == 0:
        raise _NoValue
    if isinstance(x, Fraction):
        num, den = _iroot(abs(x.numerator), deg), _iroot(x.denominator, deg)
        if num is not None and den is not None:
            return sign * Fraction(num, den)
    return sign * abs(_float(x)) ** (1.0 / deg)


def _power(base: Value, exp: Value) -> Value:
    if isinstance(base, Fraction) and isinstance(exp, Fraction):
        if exp.denominator == 1:
            bits = max(base.numerator.bit_length(), base.denominator.bit_length())
            if bits * abs(exp.numerator) > _MAX_BITS:
                raise _NoValue
            if base == 0 and exp < 0:
                raise _NoValue
            return base**exp.numerator
        if base >= 0 or exp.denominator % 2 == 1:
            return _power(_root(base, Fraction(exp.denominator)), Fraction(exp.numerator))
    try:
        out = _float(base) ** _float(exp)
    except OverflowError as e:
        raise _NoValue from e
    except ZeroDivisionError as e:
        raise _NoValue from e
    if isinstance(out, complex):
        raise _NoValue
    return out


class _Parser:
    """Recursive descent over the tokens of one scalar: sums of products of signed powers."""

    def __init__(self, text: str) -> None:
        self.toks: list[str] = []
        pos = 0
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if m is None:  # only trailing whitespace is left
                break
            self.toks.append(m.group(m.lastindex or 0))
            pos = m.end()
        self.i = 0
        self.literal = False  # whether the last factor read was a bare number

    def peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, expected: str | None = None) -> str:
        tok = self.peek()
        if tok is None or (expected is not None and tok != expected):
            raise _Unreadable
        self.i += 1
        return tok

    def parse(self) -> Value:
        value = self.expr()
        if self.peek() is not None:
            raise _Unreadable
        return value

    def expr(self) -> Value:
        value = self.term()
        while self.peek() in ("+", "-"):
            sign = self.take()
            right = self.term()
            value = value + right if sign == "+" else value - right
        return value

    def term(self) -> Value:
        value = self.unary()
        while True:
            tok = self.peek()
            if tok in ("*", "\\cdot", "\\times"):
                self.take()
                value = value * self.unary()
            elif tok in ("/", "\\div"):
                self.take()
                value = _divide(value, self.unary())
            elif tok in ("\\pi", "\\sqrt", "(", "\\binom") or (
                tok == "\\frac" and not self.literal
            ):
                # Implicit products (2\pi, 3\sqrt{2}). Not a number then \frac: after a whole
                # number "\frac{1}{2}" is a mixed number's fraction, so "2\frac{\pi}{3}" is left
                # unread rather than guessed.
                value = value * self.power()
            else:
                return value

    def unary(self) -> Value:
        if self.peek() == "-":
            self.take()
            return -self.unary()
        if self.peek() == "+":
            self.take()
            return self.unary()
        return self.power()

    def power(self) -> Value:
        base = self.atom()
        if self.peek() != "^":
            return base
        self.take()
        exp = self.group() if self.peek() == "{" else self.single()
        self.literal = False
        if self.peek() == "^":  # a double superscript is a LaTeX error, not a tower
            raise _Unreadable
        return _power(base, exp)

    def group(self) -> Value:
        self.take("{")
        value = self.expr()
        self.take("}")
        return value

    def single(self) -> Value:
        """A one-token argument as LaTeX reads it: "\\frac12" is 1/2, "2^10" is 2^1 then 0."""
        tok = self.peek()
        if tok is None or not (tok[0].isdigit() or tok[0] == "."):
            return self.atom()
        if not tok.isdigit():  # "\frac1.5" or "10^1.5": LaTeX would split these mid-number
            raise _Unreadable
        if len(tok) > 1:
            self.toks[self.i] = tok[1:]
        else:
            self.i += 1
        return Fraction(int(tok[0]))

    def mixed_fraction(self) -> Fraction | None:
        """A proper fraction of digits right after a whole number ("2\\frac{1}{2}", "2\\frac12"),
        read as a mixed number, 2.5 (math-verify reads the product, 1), else None."""
        t = self.toks[self.i : self.i + 7]
        if t[:2] == ["\\frac", "{"] and len(t) == 7 and t[3:5] == ["}", "{"] and t[6] == "}":
            num, den, used = t[2], t[5], 7
        elif len(t) >= 2 and t[0] == "\\frac" and t[1].isdigit() and len(t[1]) == 2:
            num, den, used = t[1][0], t[1][1], 2
        else:
            return None
        if not (num.isdigit() and den.isdigit()) or not 0 < int(num) < int(den):
            return None
        self.i += used
        return Fraction(int(num), int(den))

    def arg(self) -> Value:
        return self.group() if self.peek() == "{" else self.single()

    def atom(self) -> Value:
        tok = self.take()
        value = self._atom(tok)
        # Set after the arguments are read: the last factor of "\frac{1}{2}" is not a bare number.
        self.literal = tok[0].isdigit() or tok[0] == "."
        return value

    def _atom(self, tok: str) -> Value:
        if tok[0].isdigit() or tok[0] == ".":
            whole = _number(tok)
            part = self.mixed_fraction() if tok.isdigit() else None
            return whole if part is None else whole + part
        if tok == "\\pi":
            return math.pi
        if tok == "\\infty":
            return math.inf
        if tok in ("(", "{"):
            value = self.expr()
            self.take(_OPENERS[tok])
            return value
        if tok == "\\frac":
            num = self.arg()
            return _divide(num, self.arg())
        if tok == "\\binom":
            n, k = self.arg(), self.arg()
            if not all(isinstance(v, Fraction) and v.denominator == 1 for v in (n, k)):
                raise _Unreadable
            if n < 0 or n.numerator.bit_length() > 16:
                raise _Unreadable
            return Fraction(math.comb(int(n), int(k)) if k >= 0 else 0)
        if tok == "\\sqrt":
            index: Value = Fraction(2)
            if self.peek() == "[":
                self.take()
                index = self.expr()
                self.take("]")
            return _root(self.arg(), index)
        raise _Unreadable


def _number(tok: str) -> Fraction:
    mantissa, _, exp = tok.lower().partition("e")
    if len(exp.lstrip("+-")) > _MAX_EXPONENT_DIGITS:
        raise _NoValue
    try:
        value = Fraction(Decimal(mantissa))
    except (InvalidOperation, ValueError) as e:
        raise _Unreadable from e
    return value * Fraction(10) ** int(exp) if exp else value


def _divide(a: Value, b: Value) -> Value:
    if b == 0:
        raise _NoValue
    return a / b


def normalise(text: str) -> str:
    s = text.strip().replace("\\$", " ").replace("$", " ")
    for char, latex in _UNICODE.items():
        s = s.replace(char, latex)
    s = _DELIMITER.sub("", s)
    for delim in ("\\(", "\\)", "\\[", "\\]"):
        s = s.replace(delim, " ")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("\\displaystyle", " ").replace("\\%", "%")
    # \text{12} is the number itself; \text{ cm} is a unit and dropped.
    s = TEXT_GROUP.sub(lambda m: m.group(1) if _NUMBERISH.fullmatch(m.group(1)) else " ", s)
    s = _DEGREES.sub(" ", s)
    s = _GROUP_SEP.sub("", s).replace("{,}", ",")
    s = _SPACE.sub(" ", s)
    return s.strip().rstrip(".").strip()


def top_level(text: str, seps: set[str]) -> list[tuple[int, str]] | None:
    """Positions of separators outside brackets, or None if the brackets do not balance."""
    depth, out, i = 0, [], 0
    while i < len(text):
        two = text[i : i + 2]
        tok = two if two in ("\\{", "\\}") else text[i]
        if tok in _OPENERS:
            depth += 1
        elif tok in _CLOSERS:
            depth -= 1
            if depth < 0:
                return None
        elif depth == 0:
            sep = next((s for s in seps if text.startswith(s, i)), None)
            if sep is not None:
                out.append((i, sep))
        i += len(tok)
    return out if depth == 0 else None


def _scalar(text: str) -> Scalar:
    text = text.strip()
    percent = text.endswith("%")
    text = text.removesuffix("%").strip()
    if _GROUPED.fullmatch(text):
        text = text.replace(",", "")
    if not text:
        raise _Unreadable
    value = _Parser(text).parse()
    if isinstance(value, float) and math.isnan(value):  # \infty - \infty
        raise _NoValue
    return Scalar(value, percent)


def _items(inner: str) -> tuple[Scalar, ...]:
    commas = top_level(inner, {","})
    if commas is None:
        raise _Unreadable
    bounds = [-1, *(pos for pos, _ in commas), len(inner)]
    return tuple(_scalar(inner[a + 1 : b]) for a, b in zip(bounds, bounds[1:], strict=False))


def _read(text: str) -> Answer:
    s = normalise(text)
    relations = top_level(s, RELATIONS)
    if relations is None:
        raise _Unreadable
    if relations:
        pos, sep = relations[-1]
        s = s[pos + len(sep) :].strip()
    if s.startswith("\\{") and s.endswith("\\}") and top_level(s[2:-2], {","}) is not None:
        return Group("{", "}", _items(s[2:-2]))
    if not s:
        raise _Unreadable
    # "(1, 2)" and "[0, 1)" are groups; "(1)(2)" is not, its first bracket closes early.
    if s[0] in "([" and s[-1] in ")]" and top_level(s[1:-1], {","}):
        return Group(s[0], s[-1], _items(s[1:-1]))
    commas = top_level(s, {","})
    if commas and not _GROUPED.fullmatch(s.removesuffix("%").strip()):
        return Group("{", "}", _items(s))
    return _scalar(s)


def read_answer(text: str | None) -> Answer | None:
    """`text` read as a number or a group of numbers, or None if any of it is unreadable (see the
    module docstring). Never raises."""
    if text is None or not text.strip() or len(text) > MAX_CHARS:
        return None
    try:
        return _read(text)
    except _NoValue:
        return Scalar(math.nan)
    except (_Unreadable, ArithmeticError, ValueError, TypeError, RecursionError):
        return None
