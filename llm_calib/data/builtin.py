"""Built-in, procedurally generated questions for offline tests and demos: multiple choice over
:data:`BUILTIN_DOMAINS` (described in :doc:`/tutorials/evaluate_llm`) and open questions.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence

from llm_calib.data.records import MultipleChoice, OpenQA

__all__ = ["BUILTIN_DOMAINS", "BUILTIN_OPEN_DOMAINS", "CAPITALS", "ELEMENTS", "builtin_multiple_choice", "builtin_open_questions"]

BUILTIN_DOMAINS: tuple[str, ...] = ("arithmetic", "unit_conversion", "calendar", "capitals", "chemical_symbols")
"""The domains of :func:`builtin_multiple_choice`, in output order."""

CAPITALS: tuple[tuple[str, str, str, str], ...] = (
    ("France", "Paris", "Europe", "Lyon"), ("Germany", "Berlin", "Europe", "Munich"),
    ("Italy", "Rome", "Europe", "Milan"), ("Spain", "Madrid", "Europe", "Barcelona"),
    ("Portugal", "Lisbon", "Europe", "Porto"), ("the Netherlands", "Amsterdam", "Europe", "Rotterdam"),
    ("Belgium", "Brussels", "Europe", "Antwerp"), ("Austria", "Vienna", "Europe", "Salzburg"),
    ("Switzerland", "Bern", "Europe", "Zurich"), ("Sweden", "Stockholm", "Europe", "Gothenburg"),
    ("Norway", "Oslo", "Europe", "Bergen"), ("Denmark", "Copenhagen", "Europe", "Aarhus"),
    ("Finland", "Helsinki", "Europe", "Tampere"), ("Poland", "Warsaw", "Europe", "Krakow"),
    ("Greece", "Athens", "Europe", "Thessaloniki"), ("Hungary", "Budapest", "Europe", "Debrecen"),
    ("Ireland", "Dublin", "Europe", "Cork"), ("the Czech Republic", "Prague", "Europe", "Brno"),
    ("Romania", "Bucharest", "Europe", "Cluj-Napoca"), ("Ukraine", "Kyiv", "Europe", "Odesa"),
    ("Japan", "Tokyo", "Asia", "Osaka"), ("China", "Beijing", "Asia", "Shanghai"),
    ("India", "New Delhi", "Asia", "Mumbai"), ("South Korea", "Seoul", "Asia", "Busan"),
    ("Thailand", "Bangkok", "Asia", "Chiang Mai"), ("Vietnam", "Hanoi", "Asia", "Ho Chi Minh City"),
    ("Indonesia", "Jakarta", "Asia", "Surabaya"), ("the Philippines", "Manila", "Asia", "Cebu City"),
    ("Pakistan", "Islamabad", "Asia", "Karachi"), ("Iran", "Tehran", "Asia", "Isfahan"),
    ("Turkey", "Ankara", "Asia", "Istanbul"), ("Saudi Arabia", "Riyadh", "Asia", "Jeddah"),
    ("Malaysia", "Kuala Lumpur", "Asia", "Penang"), ("Nepal", "Kathmandu", "Asia", "Pokhara"),
    ("Egypt", "Cairo", "Africa", "Alexandria"), ("Kenya", "Nairobi", "Africa", "Mombasa"),
    ("Nigeria", "Abuja", "Africa", "Lagos"), ("Ethiopia", "Addis Ababa", "Africa", ""),
    ("Morocco", "Rabat", "Africa", "Casablanca"), ("Ghana", "Accra", "Africa", "Kumasi"),
    ("Senegal", "Dakar", "Africa", ""), ("Algeria", "Algiers", "Africa", "Oran"), ("Uganda", "Kampala", "Africa", ""),
    ("Canada", "Ottawa", "Americas", "Toronto"), ("Mexico", "Mexico City", "Americas", "Guadalajara"),
    ("Brazil", "Brasília", "Americas", "Rio de Janeiro"), ("Argentina", "Buenos Aires", "Americas", "Córdoba"),
    ("Chile", "Santiago", "Americas", "Valparaíso"), ("Peru", "Lima", "Americas", "Cusco"),
    ("Colombia", "Bogotá", "Americas", "Medellín"), ("Cuba", "Havana", "Americas", "Santiago de Cuba"),
    ("Venezuela", "Caracas", "Americas", "Maracaibo"),
    ("the United States", "Washington, D.C.", "Americas", "New York City"),
    ("Australia", "Canberra", "Oceania", "Sydney"), ("New Zealand", "Wellington", "Oceania", "Auckland"),
    ("Fiji", "Suva", "Oceania", "Nadi"),
)  # fmt: skip
"""Country capital facts, tuples ``(country, capital, continent, well-known wrong answer or "")``."""

ELEMENTS: tuple[tuple[str, str], ...] = (
    ("hydrogen", "H"), ("helium", "He"), ("lithium", "Li"), ("beryllium", "Be"), ("boron", "B"), ("carbon", "C"),
    ("nitrogen", "N"), ("oxygen", "O"), ("fluorine", "F"), ("neon", "Ne"), ("sodium", "Na"), ("magnesium", "Mg"),
    ("aluminium", "Al"), ("silicon", "Si"), ("phosphorus", "P"), ("sulfur", "S"), ("chlorine", "Cl"), ("argon", "Ar"),
    ("potassium", "K"), ("calcium", "Ca"), ("titanium", "Ti"), ("chromium", "Cr"), ("manganese", "Mn"),
    ("iron", "Fe"), ("cobalt", "Co"), ("nickel", "Ni"), ("copper", "Cu"), ("zinc", "Zn"), ("arsenic", "As"),
    ("selenium", "Se"), ("bromine", "Br"), ("krypton", "Kr"), ("strontium", "Sr"), ("silver", "Ag"),
    ("cadmium", "Cd"), ("tin", "Sn"), ("antimony", "Sb"), ("iodine", "I"), ("xenon", "Xe"), ("barium", "Ba"),
    ("neodymium", "Nd"), ("tungsten", "W"), ("platinum", "Pt"), ("gold", "Au"), ("mercury", "Hg"), ("lead", "Pb"),
    ("bismuth", "Bi"), ("radon", "Rn"), ("uranium", "U"), ("plutonium", "Pu"),
)  # fmt: skip
"""Chemical element facts, tuples ``(name, symbol)``."""

_WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
_MONTHS = (
    "January", "February", "March", "April", "May", "June", "July", "August", "September",
    "October", "November", "December",
)  # fmt: skip
_CONVERSIONS: tuple[tuple[str, str, int], ...] = (
    ("kilometres", "metres", 1000), ("metres", "centimetres", 100),
    ("centimetres", "millimetres", 10), ("kilograms", "grams", 1000),
    ("tonnes", "kilograms", 1000), ("litres", "millilitres", 1000), ("hours", "minutes", 60),
    ("minutes", "seconds", 60), ("days", "hours", 24), ("weeks", "days", 7),
    ("years", "months", 12), ("feet", "inches", 12), ("yards", "feet", 3),
    ("pounds", "ounces", 16),
)  # fmt: skip
_COMMON_FACTORS = (3, 7, 10, 12, 16, 24, 60, 100, 1000)

# A generator yields (question, answer, three distractors), possibly repeating questions.
_Item = tuple[str, str, list[str]]


def _pick(rng: random.Random, answer: str, candidates: Sequence[str], k: int = 3) -> list[str]:
    pool = list(dict.fromkeys(c for c in candidates if c != answer))
    if len(pool) < k:
        raise AssertionError(f"not enough distractors for {answer!r}: {pool}")
    return rng.sample(pool, k)


def _arithmetic(rng: random.Random) -> Iterator[_Item]:
    while True:
        op = rng.choice("+-×")
        if op == "+":
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            ans = a + b
            near = [ans + 1, ans - 1, ans + 10, ans - 10, ans + 2, ans - 2, ans + 11]
        elif op == "-":
            a = rng.randint(20, 99)
            b = rng.randint(2, a - 1)
            ans = a - b
            near = [ans + 1, ans - 1, ans + 10, ans - 10, ans + 2, a + b]
        else:
            a, b = rng.randint(3, 15), rng.randint(3, 15)
            ans = a * b
            near = [ans + a, ans - a, ans + b, ans - b, ans + 10, ans - 1, ans + 1]
        cands = [str(x) for x in near if x > 0]
        yield f"What is {a} {op} {b}?", str(ans), _pick(rng, str(ans), cands)


def _unit_conversion(rng: random.Random) -> Iterator[_Item]:
    while True:
        big, small, factor = rng.choice(_CONVERSIONS)
        value = rng.randint(2, 15)
        ans = value * factor
        wrong = [value * factor * 10]
        if factor % 10 == 0:
            wrong.append(value * factor // 10)
        wrong += [value * g for g in _COMMON_FACTORS if g != factor]
        cands = [f"{x:,}" for x in wrong[:2]] + [f"{x:,}" for x in rng.sample(wrong[2:], 4)]
        yield f"How many {small} are in {value} {big}?", f"{ans:,}", _pick(rng, f"{ans:,}", cands)


def _calendar(rng: random.Random) -> Iterator[_Item]:
    while True:
        if rng.random() < 0.7:
            start, k = rng.randrange(7), rng.randint(2, 30)
            if rng.random() < 0.5:
                q = f"If today is {_WEEKDAYS[start]}, what day of the week will it be in {k} days?"
                ans = (start + k) % 7
            else:
                q = f"If today is {_WEEKDAYS[start]}, what day of the week was it {k} days ago?"
                ans = (start - k) % 7
            cands = [_WEEKDAYS[(ans + d) % 7] for d in (1, -1, 2, -2, 3)]
            yield q, _WEEKDAYS[ans], _pick(rng, _WEEKDAYS[ans], cands)
        else:
            start, k = rng.randrange(12), rng.randint(2, 11)
            if rng.random() < 0.5:
                q, ans = f"Which month comes {k} months after {_MONTHS[start]}?", (start + k) % 12
            else:
                q, ans = f"Which month comes {k} months before {_MONTHS[start]}?", (start - k) % 12
            cands = [_MONTHS[(ans + d) % 12] for d in (1, -1, 2, -2, 3)]
            yield q, _MONTHS[ans], _pick(rng, _MONTHS[ans], cands)


def _bare(country: str) -> str:
    return country.removeprefix("the ")


def _capitals(rng: random.Random) -> Iterator[_Item]:
    facts = [(row, forward) for row in CAPITALS for forward in (True, False)]
    rng.shuffle(facts)
    for (country, capital, continent, decoy), forward in facts:
        near = [row for row in CAPITALS if row[2] == continent and row[0] != country]
        far = [row for row in CAPITALS if row[2] != continent]
        rng.shuffle(near)
        rng.shuffle(far)
        if forward:
            q = f"What is the capital of {country}?"
            cands = [r[1] for r in near + far]
            picked = ([decoy] if decoy else []) + _pick(rng, capital, cands[:6], 3 - bool(decoy))
            yield q, capital, picked
        else:
            q, bare = f"{capital} is the capital of which country?", _bare(country)
            yield q, bare, _pick(rng, bare, [_bare(r[0]) for r in near + far][:5])


def _chemical_symbols(rng: random.Random) -> Iterator[_Item]:
    facts = [(row, forward) for row in ELEMENTS for forward in (True, False)]
    rng.shuffle(facts)
    symbols = [s for _, s in ELEMENTS]
    for (name, symbol), forward in facts:
        if forward:
            title = name.capitalize()
            look_alike = [title[:2], title[0] + title[2], title[0] + title[-1]]
            same_letter = [s for s in symbols if s[0] == title[0]]
            others = rng.sample(symbols, 6)
            cands = list(dict.fromkeys(look_alike + same_letter))
            rng.shuffle(cands)
            q = f"What is the chemical symbol for {name}?"
            yield q, symbol, _pick(rng, symbol, cands + others)
        else:
            same_letter = [n for n, _ in ELEMENTS if n[0] == symbol[0].lower()]
            others = [n for n, _ in rng.sample(ELEMENTS, 6)]
            rng.shuffle(same_letter)
            cands = same_letter[:3] + others
            q = f"Which element has the chemical symbol {symbol}?"
            yield q, name, _pick(rng, name, cands[:6])


_GENERATORS: dict[str, Callable[[random.Random], Iterator[_Item]]] = {
    "arithmetic": _arithmetic,
    "unit_conversion": _unit_conversion,
    "calendar": _calendar,
    "capitals": _capitals,
    "chemical_symbols": _chemical_symbols,
}


def _domain(domain: str, n: int, seed: int) -> list[MultipleChoice]:
    rng = random.Random(f"llm_calib.builtin/{domain}/{seed}")
    items = _GENERATORS[domain](rng)
    seen: set[str] = set()
    out: list[MultipleChoice] = []
    positions: list[int] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        item = next(items, None)
        if item is None or attempts > 200 * n + 1000:
            raise ValueError(
                f"builtin domain {domain!r} has only {len(out)} distinct questions; "
                f"n_per_domain={n} is too large"
            )
        question, answer, distractors = item
        if question in seen:
            continue
        seen.add(question)
        if not positions:
            positions = [0, 1, 2, 3]
            rng.shuffle(positions)
        gold = positions.pop()
        options = list(distractors)
        rng.shuffle(options)
        options.insert(gold, answer)
        meta = {"generator": "builtin", "seed": str(seed)}
        out.append(MultipleChoice(question, tuple(options), gold, domain, f"{domain}-{len(out)}", meta))
    return out


def builtin_multiple_choice(
    n_per_domain: int = 40, seed: int = 0, domains: Sequence[str] | None = None
) -> list[MultipleChoice]:
    """Generate ``n_per_domain`` records per domain (at most 112 for ``capitals``, 100 for
    ``chemical_symbols``), domain by domain, ids ``<domain>-<i>``; deterministic per seed.

    Example:
        >>> qs = builtin_multiple_choice(4, seed=0, domains=["capitals", "arithmetic"])
        >>> [q.domain for q in qs][3:5], sorted(q.gold for q in qs[:4])
        (['capitals', 'arithmetic'], [0, 1, 2, 3])
    """
    chosen = _chosen(n_per_domain, domains, BUILTIN_DOMAINS, "domain")
    return [q for domain in chosen for q in _domain(domain, n_per_domain, seed)]


def _chosen(n_per_domain: int, domains: Sequence[str] | None, valid: tuple[str, ...], what: str) -> tuple[str, ...]:
    """``domains`` (None: all of ``valid``), checked along with ``n_per_domain``."""
    if n_per_domain < 0:
        raise ValueError(f"n_per_domain must be >= 0, got {n_per_domain}")
    chosen = tuple(domains) if domains is not None else valid
    unknown = [d for d in chosen if d not in valid]
    if unknown:
        raise ValueError(f"unknown builtin {what}(s) {unknown}; valid: {', '.join(valid)}")
    return chosen


BUILTIN_OPEN_DOMAINS: tuple[str, ...] = ("sums", "capitals", "elements")
"""The domains of :func:`builtin_open_questions`, in output order."""


def builtin_open_questions(n_per_domain: int = 40, domains: Sequence[str] | None = None) -> list[OpenQA]:
    """The first ``n_per_domain`` open questions of ``sums`` (60), ``capitals`` (56) and
    ``elements`` (50).

    Example:
        >>> qs = builtin_open_questions(2, domains=["capitals", "sums"])
        >>> [(q.domain, q.answers) for q in qs][1:3]
        [('capitals', ('Berlin',)), ('sums', ('5',))]
    """
    chosen = _chosen(n_per_domain, domains, BUILTIN_OPEN_DOMAINS, "open domain")
    make = {
        "sums": lambda: [OpenQA(f"What is {a} plus {b}?", (str(a + b),), "sums", f"sum-{a}-{b}")
                         for a in range(2, 12) for b in range(3, 9)],
        "capitals": lambda: [OpenQA(f"What is the capital of {c[0]}?", (c[1],), "capitals", f"cap-{c[0]}") for c in CAPITALS],
        "elements": lambda: [OpenQA(f"What is the chemical symbol of {e[0]}?", (e[1],), "elements", f"el-{e[0]}")
                             for e in ELEMENTS],
    }
    return [q for d in chosen for q in make[d]()[:n_per_domain]]
