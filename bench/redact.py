"""Redaction benchmark: time per KB of ``Redactor().text`` from 1 KB to 1 MB, for texts of several shapes.

Each shape is made to the size from seeded random pieces, so that no value repeats more than chat would (a
run in ``spaced`` and ``parens`` is up to an eighth of the size, so that what a run costs shows too):

  chat        messages as users and bots write them: names after cues, e-mails, phone numbers written
              several ways, card numbers, IBANs, addresses, dates and times, order numbers, some French
              and Italian (accents: the folding path)
  emails      ``a@b.co `` again and again: 10 KB -> 40 KB once took 20 times as long
  names       a new name learned every line, and the names said again
  digits      one run of digits
  groups      digits in groups of one to four with a space between: phonenumbers' worst case
  spaced      digits far apart, with runs of spaces and of dots between them
  at signs    ``@`` alone and between letters
  capitals    capitalised words only
  parens      runs of ``(`` then a space or digits
  timestamps  log lines that start with a date and a time

It prints, for each shape, milliseconds per KB at 1 KB and, at each larger size, the time per KB as a
ratio of the 1 KB figure measured in the same run (the machine is shared: ratios, not times, are what
compare). The target is that every ratio stays within 2 (cost linear in the text). Best of a few
runs at each size, one at 1 MB. Run by hand, not part of the tests::

    .venv/bin/python bench/redact.py [--sizes 1,4,16,64,256,1024] [--shapes chat,emails] [--repeat 3]
"""

from __future__ import annotations

import argparse
import random
import string
import time
from collections.abc import Callable

from collector.redact import Redactor

FIRST = ["Anna", "Marco", "Giulia", "Tom", "Sarah", "Élodie", "Jürgen", "Ana", "Paolo", "Chloé", "Hans-Peter",
         "Maria"]
LAST = ["Rossi", "Baker", "Bianchi", "Dupont", "Müller", "de la Cruz", "Connor", "O'Brien", "Fernández", "Smith"]


def card(rng: random.Random) -> str:
    digits = [rng.randrange(10) for _ in range(15)]
    total = sum(d if i % 2 else (d * 2 - 9 if d > 4 else d * 2) for i, d in enumerate(reversed(digits)))
    number = "".join(map(str, digits)) + str(-total % 10)
    sep = rng.choice([" ", "-", "", "\u00a0", "."])
    return sep.join(number[i:i + 4] for i in range(0, 16, 4))


def iban(rng: random.Random) -> str:
    bban = "".join(rng.choice(string.ascii_uppercase) for _ in range(4)) + "".join(
        rng.choice(string.digits) for _ in range(14))
    check = 98 - int("".join(str(int(c, 36)) for c in bban + "GB00")) % 97
    compact = f"GB{check:02d}{bban}"
    return " ".join(compact[i:i + 4] for i in range(0, len(compact), 4))


def phone(rng: random.Random) -> str:
    n = rng.randrange(1000)
    return rng.choice([f"+44 20 7946 0{n:03d}", f"020 7946 0{n:03d}", f"+44 7700 900{n:03d}",
                       f"(415) 555-{2600 + n % 100}", f"06 12 34 {n % 100:02d} 78",
                       f"+33\u00a06\u00a012\u00a034\u00a056\u00a0{n % 100:02d}"])


def chat(rng: random.Random) -> str:
    first, last = rng.choice(FIRST), rng.choice(LAST)
    n = rng.randrange(10_000)
    return rng.choice([
        f"Hi, my name is {first} {last} and I need to change my booking for order B-{n}.",
        f"Sure, {first}. What is your email and phone number? It left on 2026-11-{n % 28 + 1:02d} at 10:{n % 60:02d}.",
        f"{first.lower()}.{last.lower().replace(' ', '')}{n}@example.com, {phone(rng)}",
        f"card {card(rng)}, or my IBAN {iban(rng)}. I live at {n % 300 + 1} Baker Street.",
        f"je m'appelle {first}, j'habite au {n % 90 + 1} rue de la Paix, appelez-moi au {phone(rng)}",
        f"mi chiamo {first} {last}, abito in via Roma {n % 200 + 1}; la versione è 2.{n % 20}.3",
        f"Thanks, {first}! Your ticket {n} is open; I am very sorry for the wait, it took {n % 9} days.",
        f'{{"first_name": "{first}", "last_name": "{last}", "plan": "gold", "visits": {n % 40}}}',
        "The pain is 7 out of 10 since this morning, and it gets worse when I climb the stairs.",
    ]) + "\n"


def names(rng: random.Random) -> str:
    name = "".join(rng.choice(string.ascii_lowercase) for _ in range(7)).capitalize()
    return f"my name is {name} {rng.choice(LAST)}. {rng.choice(FIRST)} said {name} would call.\n"


SHAPES: dict[str, Callable[[random.Random, int], str]] = {
    "chat": lambda rng, size: chat(rng),
    "emails": lambda rng, size: "a@b.co ",
    "names": lambda rng, size: names(rng),
    "digits": lambda rng, size: str(rng.randrange(10)),
    "groups": lambda rng, size: str(rng.randrange(10 ** rng.randint(1, 4))) + " ",
    "spaced": lambda rng, size: (str(rng.randrange(10)) + " " * rng.randint(1, size // 8)
                                 + str(rng.randrange(10)) + "." * rng.randint(1, size // 8)),
    "at signs": lambda rng, size: rng.choice(["@", "a@", "@@@", "x@y@", "@a."]),
    "capitals": lambda rng, size: rng.choice(FIRST[:5]) + rng.choice(["", "a", "ne", "lli"]) + " ",
    "parens": lambda rng, size: "(" * rng.randint(1, size // 8) + rng.choice([" ", "1 ", "(1 2 "]),
    "timestamps": lambda rng, size: (f"29.11.2026 {rng.randrange(24):02d}:{rng.randrange(60):02d}:"
                                     f"{rng.randrange(60):02d} user {rng.randrange(10 ** 6)} asked about order "
                                     f"B-{rng.randrange(10 ** 4)}\n"),
}


def text(shape: str, size: int) -> str:
    rng = random.Random(size)  # each size its own text, the same from run to run
    pieces, length = [], 0
    while length < size:
        pieces.append(SHAPES[shape](rng, size))
        length += len(pieces[-1])
    return "".join(pieces)[:size]


def ms_per_kb(s: str, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        Redactor().text(s)
        best = min(best, time.perf_counter() - started)
    return best * 1000 / (len(s) / 1024)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,4,16,64,256,1024", help="sizes in KB, the first the baseline")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--repeat", type=int, default=3, help="runs at each size up to 256 KB, the best kept")
    args = ap.parse_args()
    sizes = [int(k) for k in args.sizes.split(",")]
    shapes = args.shapes.split(",")
    for shape in shapes:
        Redactor().text(text(shape, 4096))  # phonenumbers reads a region's metadata the first time
    print(f"{'':12} {f'{sizes[0]} KB':>9}  " + " ".join(f"{f'{k} KB' if k < 1024 else f'{k // 1024} MB':>8}"
                                                      for k in sizes[1:]))
    print(f"{'':12} {'ms/KB':>9}  " + " ".join(f"{'ratio':>8}" for _ in sizes[1:]))
    worst = 0.0
    for shape in shapes:
        base, *rest = (ms_per_kb(text(shape, k * 1024), args.repeat if k <= 256 else 1) for k in sizes)
        ratios = [t / base for t in rest]
        worst = max(worst, *ratios)
        print(f"{shape:12} {base:9.2f}  " + " ".join(f"{r:8.2f}" for r in ratios), flush=True)
    print(f"largest ratio {worst:.2f}: {'within' if worst <= 2 else 'NOT within'} 2 (time per KB flat from "
          f"{sizes[0]} KB to {sizes[-1]} KB)")


if __name__ == "__main__":
    main()
