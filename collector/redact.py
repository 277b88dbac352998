"""Redaction of personal data, with consistent placeholders, before anything leaves the machine.

Used before a scenario file is written or a transcript is sent to a drafting model, by
conversation exports with ``--redact``, and by forwarding. One :class:`Redactor` serves one
document (a scenario, or one exported conversation): the same value gets the same placeholder
throughout it (``<PERSON_1>``, ``<PHONE_1>``, ``<EMAIL_1>``, ``<CARD_1>``, ``<IBAN_1>``,
``<ID_1>``, ``<ADDRESS_1>``; a config pattern named ``order`` gives ``<ORDER_1>``), so a
redacted transcript still reads ("<PERSON_1> asked to move <ADDRESS_1>").

The detectors read the text folded: digits of any script as 0-9 (full-width "４", Arabic-Indic
"٤"), any space as a space (no-break, thin, narrow no-break), any dash as "-", full-width and
mathematical letters as ASCII, and invisible characters (soft hyphen, zero-width space, joiners,
bidi controls) left out. A placeholder covers the value as it was written, invisible characters
inside it too, and one value written two ways gets one placeholder.

What it catches (detector names as in :class:`Finding`):

- ``email``: anything shaped ``local@domain.tld``, or with an IP address for a domain
  (``user@192.168.0.1``, ``user@[192.168.0.1]``).
- ``phone``: what ``phonenumbers`` finds valid for the number as written, as an international
  number (with ``+`` or ``00``, or grouped digits that read as one with a ``+`` in front), or as a
  national number of the US, GB, FR, IT, DE or ES. Written with its ``+``, a number of a length its
  country uses counts even when not valid (``+44 7700 900123``: the UK keeps that range for
  drama). Order numbers, dates, times and version strings are not valid numbers, so they stay.
- ``card``: 13 to 19 digits that pass the Luhn check, with no separator, with one kind throughout
  (spaces, ``-``, ``/``, ``_`` or ``.``), or grouped as cards are (4-4-4-4, 4-6-5) with any mix.
- ``iban``: a country code, two check digits and 11 to 30 letters or digits (grouped by four with
  spaces, dashes or dots, or not) whose mod-97 checksum holds.
- ``national_id``: US social security numbers (``ddd-dd-dddd``), UK National Insurance numbers
  (``AB123456C``), Italian codici fiscali (16 characters), French NIR/INSEE numbers (13 digits
  and a 2-digit key, key checked; grouped with spaces, dots or dashes or not), Spanish DNI and NIE
  (8 digits or X/Y/Z and 7, and a letter, letter checked: ``12345678Z``, ``12.345.678-Z``,
  ``X-1234567-L``).
- ``address``: a house number and a street in English ("12 Baker Street", "221B Baker St"),
  French ("5 rue de la Paix", "rue de la Paix 5"), Italian ("via Roma 12"), Spanish ("calle
  Mayor 7"), Portuguese ("rua Augusta 10") and German ("Hauptstraße 3", "Berliner Str. 5").
- ``person``: names learned from cues (the user says "my name is", "I'm", "je m'appelle",
  "mi chiamo", "me llamo", "ich heiße", "meu nome é", "اسمي" ...; a greeting or sign-off
  addresses someone: "Hi Anna,", "Thanks, Anna", "Best, Anna", "sorry, Tom."; a title: "Dear Mr Rossi"; a
  name field in a tool's JSON) and names the caller gives (``user.name``, ``enduser.id``).
  After a weak cue ("I'm", "this is", "sono", "soy", "je suis", "ich bin") only capitalised
  words count, on the same line, minus a stop list of common words ("I'm Sorry", "I am Having"),
  and not on a line where nearly every word is capitalised. A learned name is replaced wherever
  it occurs in the document, whole word and whatever the case, and so are its parts (a first
  name alone, a surname alone).

What it cannot catch: a name with no cue ("Anna said yes", "ask Marco"), a name written in
lowercase after a weak cue ("i'm anna"), an address with no house number or a street name in
lowercase ("baker street", "via roma 12"), postcodes and cities, ids of other countries and
other kinds of id (passports, health insurance numbers: add a config pattern), phone numbers of
other regions written without their country code, two phone numbers with only a space between
them (read as one invalid number), and anything paraphrased. Nor what is disguised beyond the
folding above: a value broken across lines, digits spelled out or written with look-alikes ("O"
for 0, superscripts, circled digits), letters of another script that look Latin (a Cyrillic "а"
in "Аnna"), an email with spaces around "@" or with "at" and "dot", a card number grouped
neither regularly nor with one separator ("41 11-1111 1111 1111"), ids and IBANs with other
separators. It errs towards redacting: a name that is also a word ("Will", "Rose") is replaced as
the word too, a capitalised German noun after "ich bin" ("ich bin Lehrer") is taken for a name, a
bare run of 9 or 10 digits that is a valid number in one of the regions (an order number can be)
counts as a phone, and so does a "+" before digits of a length some country uses.

Its cost grows as the text does (``bench/redact.py`` measures it from 1 KB to 1 MB): no repeat in
the patterns that could backtrack is unbounded, learned names are looked up word by word, and a
match is checked for overlap against a mask of those accepted, not against each of them.
"""

from __future__ import annotations

import json
import time
import unicodedata
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import phonenumbers
import regex

PATTERN_TIMEOUT = 1.0
"""Seconds a config pattern may spend on one text before redaction gives up with TimeoutError."""
PHONE_REGIONS: tuple[str | None, ...] = (None, "US", "GB", "FR", "IT", "DE", "ES")
"""Regions whose national numbers are recognised; ``None`` is international numbers only."""
NAME_ATTRIBUTES = ("user.name", "user.full_name", "enduser.id")
"""Conversation attributes :meth:`Redactor.record` takes as names given."""

_PREFIX = {"email": "EMAIL", "iban": "IBAN", "card": "CARD", "national_id": "ID",
           "phone": "PHONE", "address": "ADDRESS", "person": "PERSON"}
# Any placeholder, ours or another redactor's: never redacted again, never a finding.
_PLACEHOLDER = regex.compile(r"<[A-Z][A-Z0-9_]*_\d+>")
_PATTERN_NAME = regex.compile(r"[A-Za-z][A-Za-z0-9_]*")


@dataclass(frozen=True)
class Finding:
    """A value a detector matches in a text: ``text[start:end]``."""

    detector: str
    """``"email"``, ``"phone"``, ``"card"``, ``"iban"``, ``"national_id"``, ``"address"``, ``"person"``,
    or a config pattern's name."""
    start: int
    end: int


# --- what the detectors read ------------------------------------------------------------------

# Characters written in place of a digit, a space or a dash: digits of any script, any space (no-break,
# thin, narrow no-break, ideographic), any dash, full-width and mathematical letters and digits.
_FOLDED = regex.compile(r"(?V1)[[\p{Nd}\p{Zs}\p{Pd}\uff01-\uff5e\U0001d400-\U0001d7ff]--[0-9 \-]]")
# Characters that show nothing (soft hyphen, zero-width space and joiners, word joiner, bidi controls).
_INVISIBLE = regex.compile(r"\p{Default_Ignorable_Code_Point}")


def _fold(m: regex.Match[str]) -> str:
    c = m.group()
    category = unicodedata.category(c)
    if category == "Nd":
        return str(unicodedata.decimal(c))
    # The full-width and mathematical forms are one character each in NFKC too.
    return " " if category == "Zs" else "-" if category == "Pd" else unicodedata.normalize("NFKC", c)


def _skeleton(s: str) -> tuple[str, list[int]]:
    """``s`` as the detectors read it, and where in that each character left out of it was.

    Each character of ``s`` is one of the skeleton's (``_FOLDED`` ones as the ASCII they stand for), but
    invisible ones, which are left out: a card number with zero-width spaces between its groups is a card
    number, an email with a soft hyphen in it an email.
    """
    if s.isascii():
        return s, []
    t = _FOLDED.sub(_fold, s)
    dropped = [m.start() - n for n, m in enumerate(_INVISIBLE.finditer(t))]
    return (_INVISIBLE.sub("", t) if dropped else t), dropped


def _in_original(found: list[tuple[int, int, str, str]], dropped: list[int]) -> list[tuple[int, int, str, str]]:
    """Spans in a skeleton as spans of the text it was made from (the invisible characters inside them too)."""
    if not dropped:
        return found
    return [(start + bisect_right(dropped, start), end + bisect_right(dropped, end - 1), detector, key)
            for start, end, detector, key in found]


# --- values with a checksum or a fixed shape -------------------------------------------------

# A detector finds (start, end, key) in a text; ``covered(start, end)`` says whether that span is taken
# by values found before, of detectors that come first (it may skip its work there: no match would be kept).
_Covered = Callable[[int, int], bool]
_Detector = Callable[[str, _Covered], Iterable[tuple[int, int, str]]]

# A domain's labels are counted: an unbounded repeat backtracks in time that grows as its square.
_EMAIL = regex.compile(r"(?<![\w.+-])[\w.+-]+@(?:(?:[\w-]+\.){1,30}[^\W\d_]{2,}|\d{1,3}(?:\.\d{1,3}){3}"
                       r"|\[(?:IPv6:)?[\dA-F:.]{2,45}\])(?![\w-])", regex.I)
# 13 to 19 digits, with one kind of separator throughout ("4111.1111.1111.1111") or grouped as cards
# are (4-4-4-4, 4-6-5) with any mix of them. Each repeat is bounded: a run of digits costs no more than
# its length, whatever it holds.
_CARD_GAP = r"(?:[ ]{1,2}|[ ]?[-/_.][ ]?)"
_CARD = regex.compile(r"(?<![\d-])(?<!\d[/_.])\d(?:"
                      + "|".join(rf"(?:{sep}?\d){{12,18}}" for sep in ("[ ]", "-", "/", "_", r"\."))
                      + rf"|\d{{3}}(?:{_CARD_GAP}\d{{4}}){{3}}(?:{_CARD_GAP}\d{{1,3}})?"
                      + rf"|\d{{3}}{_CARD_GAP}\d{{6}}{_CARD_GAP}\d{{4,5}})(?!\d)")
_IBAN = regex.compile(r"\b[A-Z]{2}\d{2}(?:[ .\-]?[A-Z0-9]{4}){2,7}(?:[ .\-]?[A-Z0-9]{1,3})?\b", regex.I)
_IBAN_LAST_GROUP = regex.compile(r"[ .\-][A-Z0-9]*$", regex.I)
_SSN = regex.compile(r"(?<![\d-])(?!000|666|9)\d{3}-(?!00)\d{2}-(?!0000)\d{4}(?![\d-])")
_NINO = regex.compile(r"\b(?!BG|GB|KN|NK|NT|TN|ZZ)[A-CEGHJ-PR-TW-Z][A-CEGHJ-NPR-TW-Z]"
                      r" ?\d{2} ?\d{2} ?\d{2} ?[A-D]\b", regex.I)
# Omocodia swaps digits for LMNPQRSTUV, so digit positions take those letters too.
_CODICE_FISCALE = regex.compile(r"\b[A-Z]{6}[\dL-NP-V]{2}[A-EHLMPR-T][\dL-NP-V]{2}[A-Z][\dL-NP-V]{3}[A-Z]\b",
                                regex.I)
_NIR = regex.compile(r"(?<!\d)[12][ .\-]?\d{2}[ .\-]?\d{2}[ .\-]?(?:\d{2}|2[AB])[ .\-]?\d{3}[ .\-]?\d{3}"
                     r"[ .\-]?\d{2}(?!\d)", regex.I)
# "12345678Z", "12.345.678-Z", "X-1234567-L"; after a space only a capital counts ("12345678 y" is Spanish).
_DNI = regex.compile(r"\b(?<!\d\.)(?:\d{8}|\d{2}[. ]\d{3}[. ]\d{3}|(?i:[XYZ])[ -]?\d{7})"
                     r"(?:-?(?i:[A-Z])|[ ]-?[ ]?[A-Z])\b")
_PHONE_CANDIDATE = regex.compile(r"(?<![\w+])(?:\+|00)?\(?\d(?:[ ().\-/]{0,4}\d)+")
_DIGIT_RUN = regex.compile(r"\d+")
_INTERNATIONAL_GROUPS = regex.compile(r"\d{1,3}[ .-]\d")
# phonenumbers knows ISO dates before a time, not "29.11.2026 10:02".
_DATE = regex.compile(r"(?<![\d./-])(?:\d{1,2}[./-]\d{1,2}[./-](?:\d{4}|\d{2})|\d{4}[./-]\d{1,2}[./-]\d{1,2})"
                      r"(?![./-]?\d)")


def _digits(s: str) -> str:
    return "".join(c for c in s if c.isdigit())


def _luhn(digits: str) -> bool:
    total = 0
    for i, c in enumerate(reversed(digits)):
        d = int(c) * (2 if i % 2 else 1)
        total += d - 9 if d > 9 else d
    return total % 10 == 0


def _iban_ok(compact: str) -> bool:
    moved = compact[4:] + compact[:4]
    return 15 <= len(compact) <= 34 and int("".join(str(int(c, 36)) for c in moved)) % 97 == 1


def _nir_ok(compact: str) -> bool:
    # Corsica's departments 2A and 2B count as 19 and 18 in the key.
    body = compact[:13].replace("2A", "19").replace("2B", "18")
    return 97 - int(body) % 97 == int(compact[13:])


def _dni_ok(compact: str) -> bool:
    number = compact[:-1].translate(str.maketrans("XYZ", "012"))
    return "TRWAGMYFPDXBNJZSQVHLCKE"[int(number) % 23] == compact[-1]


def _compact(s: str) -> str:
    return "".join(c for c in s if c.isalnum()).upper()


def _emails(s: str, _covered: _Covered) -> Iterator[tuple[int, int, str]]:
    for m in _EMAIL.finditer(s):
        yield m.start(), m.end(), m.group().lower()


def _cards(s: str, _covered: _Covered) -> Iterator[tuple[int, int, str]]:
    for m in _CARD.finditer(s):
        if _luhn(digits := _digits(m.group())):
            yield m.start(), m.end(), digits


def _ibans(s: str, _covered: _Covered) -> Iterator[tuple[int, int, str]]:
    for m in _IBAN.finditer(s):
        # A word after the number can join the last group: drop trailing groups until it checks.
        text = m.group()
        while text:
            if _iban_ok(compact := _compact(text)):
                yield m.start(), m.start() + len(text), compact
                break
            last = _IBAN_LAST_GROUP.search(text)
            text = text[: last.start()] if last else ""


def _national_ids(s: str, _covered: _Covered) -> Iterator[tuple[int, int, str]]:
    checks = ((_SSN, None), (_NINO, None), (_CODICE_FISCALE, None), (_NIR, _nir_ok), (_DNI, _dni_ok))
    for pattern, check in checks:
        for m in pattern.finditer(s):
            compact = _compact(m.group())
            if check is None or check(compact):
                yield m.start(), m.end(), compact


def _phones(s: str, covered: _Covered) -> Iterator[tuple[int, int, str]]:
    # Dates are never phone numbers: they are blanked out (a line break is no part of a number), as are the
    # values found before (cards, IBANs): only digit runs long enough to be a number are left for
    # phonenumbers, which is slow next to a regex.
    s = _DATE.sub(lambda m: "\n" * len(m.group()), s)
    for cand in _PHONE_CANDIDATE.finditer(s):
        if len(_digits(cand.group())) < 7 or all(covered(*run.span()) for run in _DIGIT_RUN.finditer(s, *cand.span())):
            continue
        # A few characters either side let the matcher see what it checks next to a number (a %, a currency).
        base = max(cand.start() - 4, 0)
        window = s[base: cand.end() + 4]
        found = _phone_matches(window)
        # Read as international only when grouped like one ("41 44 668 18 00"): a bare run of digits
        # with a "+" in front is too often some valid number somewhere.
        if not found and _INTERNATIONAL_GROUPS.match(cand.group()):
            base, window = cand.start() - 1, "+" + s[cand.start(): cand.end() + 4]
            found = list(phonenumbers.PhoneNumberMatcher(window, None))
        for m in found:
            start, end = base + m.start, base + m.end
            if cand.start() - 1 <= start and end <= cand.end():  # in the candidate, or from the "+" put before it
                yield max(start, cand.start()), end, _e164(m.number)


def _phone_matches(window: str) -> list[phonenumbers.PhoneNumberMatch]:
    """The numbers in ``window``: international ones, then those of each region."""
    found = []
    if "+" in window:  # else there is no international number for phonenumbers to find
        # Written with its "+", a number counts when it has the length its country's numbers have, assigned
        # or not: phonenumbers finds the UK's range for drama, +44 7700 900xxx, not valid.
        found = [m for m in phonenumbers.PhoneNumberMatcher(window, None, leniency=phonenumbers.Leniency.POSSIBLE)
                 if phonenumbers.is_possible_number_with_reason(m.number) == phonenumbers.ValidationResult.IS_POSSIBLE]
        if sum(len(_digits(m.raw_string)) for m in found) == len(_digits(window)):
            return found  # every digit is in an international number: the regions would find them again
    return found + [m for region in PHONE_REGIONS if region for m in phonenumbers.PhoneNumberMatcher(window, region)]


def _e164(number: phonenumbers.PhoneNumber) -> str:
    return phonenumbers.format_number(number, phonenumbers.PhoneNumberFormat.E164)


# --- addresses --------------------------------------------------------------------------------

_CAP = r"\p{Lu}[\p{L}'’-]*"
_PARTICLE = r"(?:(?i:de|del|della|delle|dei|degli|di|da|dal|dalla|do|dos|das|du|des|la|le|los|las|el)\s+" \
            r"|(?i:d|l|dell|dall)['’])"
_STREET_NAME = rf"{_PARTICLE}*{_CAP}(?:\s+{_PARTICLE}*{_CAP}){{0,3}}"
_HOUSE = r"\d{1,5}(?:[A-Za-z]\b|\s?(?i:bis|ter)\b)?"
_FR_TYPES = r"rue|avenue|boulevard|bd|place|allée|impasse|chemin|quai|route|cours"
_TYPES_FIRST = (rf"{_FR_TYPES}|via|viale|piazza|piazzale|corso|largo|vicolo|calle|c/|avenida|avda\.?|plaza"
                r"|paseo|carretera|camino|ronda|rua|travessa|praça|estrada")
# English street words that are also common words must be capitalised to count.
_EN_TYPES = (r"(?i:street|road|avenue|lane|drive|boulevard)|Way|Place|Close|Court|Crescent|Terrace|Square"
             r"|Gardens|Grove|Hill|Row|Mews|Parkway|Highway|St|Rd|Ave|Ln|Blvd|Sq|Pl|Ct")
_ADDRESSES = [regex.compile(p) for p in (
    rf"(?<![\d\p{{L}}]){_HOUSE},?\s+(?:(?:{_CAP}|\d+(?:st|nd|rd|th))\s+){{1,3}}(?:{_EN_TYPES})\b",
    rf"(?<![\d\p{{L}}]){_HOUSE},?\s+(?i:{_FR_TYPES})\s+{_STREET_NAME}",
    rf"(?<![\p{{L}}/])(?i:{_TYPES_FIRST})\s+{_STREET_NAME},?\s*(?:(?i:n[º°o.]|nº|n\.º)\s*)?{_HOUSE}(?!\d)",
    r"(?<!\p{L})(?:\p{Lu}\p{L}*(?:straße|strasse|str\.|gasse|weg|allee|platz)"
    r"|\p{Lu}\p{L}+\s+(?:Straße|Strasse|Str\.|Gasse|Weg|Allee|Platz))\s*\d{1,4}(?:[a-zA-Z]\b)?(?!\d)",
)]


def _addresses(s: str, _covered: _Covered) -> Iterator[tuple[int, int, str]]:
    for pattern in _ADDRESSES:
        for m in pattern.finditer(s):
            yield m.start(), m.end(), " ".join(m.group().split()).casefold()


# --- names ------------------------------------------------------------------------------------

# Capitalised words that follow "I'm", "sono", "Hi," ... without being a name.
_STOP = frozenset("""
sorry not having here fine good okay ok looking calling trying new going just so very really still also glad
happy sure afraid back done ready able unable interested worried concerned pregnant diabetic allergic sick ill
tired feeling writing asking wondering waiting home out in on at the a an and but or with from to for of your my
his her their our this that it there everyone everybody all team support again much customer patient user bot
assistant agent doctor nurse mum mom dad sir madam friend friends guys folks colleague today tomorrow yesterday
monday tuesday wednesday thursday friday saturday sunday january february march april may june july august
september october november december english british american canadian australian irish scottish italian french
german spanish how what why when where who which can could would will please let welcome i we you is are do does
did have has yes no thank thanks great hello hi hey dear morning afternoon evening spelled misspelled wrong
incorrect correct right missing listed written different same already under about over regards wishes maybe
mr mrs ms miss mx dr prof sig dott dra mme mlle sr sra srta signor
désolé désolée pas bien là ici malade enceinte content contente prêt prête monsieur madame
qui stanco stanca malato malata incinta bene pronto pronta sicuro sicura spiacente già ancora io un una il lo
per di che non signore signora
yo muy aquí nuevo nueva alérgico alérgica embarazada cliente paciente de del el la señor señora
nicht hier neu gut krank schwanger kunde kundin patientin arzt ärztin student studentin mitglied rentner
rentnerin diabetiker diabetikerin ein eine der die das auch noch schon sehr da leider froh frau herr
não eu aqui bem novo nova
""".split())
_PARTICLES = frozenset("de del della di da dal do dos das du des la le van von der den ten ter bin ben al el".split())
_NAME_WORD = r"\p{Lu}\p{Ll}[\p{L}'’-]*"
_ANY_WORD = r"\p{L}[\p{L}'’-]+"
_HONORIFIC = (r"(?:Mr|Mrs|Ms|Miss|Mx|Dr|Prof|Herr|Frau|Signor|Signora|Sig|Sig\.ra|Dott|Dott\.ssa|Mme|Mlle"
              r"|Monsieur|Madame|Sr|Sra|Srta|Señor|Señora|Dra)\.?")
_TITLED = rf"{_NAME_WORD}(?:[ \t]+(?:(?:{'|'.join(sorted(_PARTICLES))})[ \t]+)*{_NAME_WORD}){{0,2}}"
_CUES = [(regex.compile(p), loose) for p, loose in (
    # Said outright: a lowercase name counts too ("my name is anna rossi.").
    (r"(?<!\p{L})(?i:my (?:full )?name is|my name's|(?:user|customer|patient|caller)'?s name is|je m['’]appelle"
     r"|mon nom est|mi chiamo|il mio nome [èe]|me llamo|mi nombre es|ich hei(?:ß|ss)e|mein name ist"
     r"|meu nome [ée]|me chamo)[ \t]+"
     rf"(?P<name>{_TITLED}|{_ANY_WORD}[ \t]+{_ANY_WORD}(?=\s*(?:[.,;:!?)]|$|(?i:and|et|e|y|und)\b))|{_ANY_WORD})",
     False),
    (rf"(?<!\p{{L}})اسمي\s+(?P<name>\p{{Arabic}}{{2,}}|{_TITLED})", False),
    # Weak cues: only a capitalised word on the same line ("I'm sorry" and "I'm. Sorry" are not names).
    (r"(?<!\p{L})(?i:i['’]m|i am|this is|call me|je suis|sono|soy|ich bin|hier ist|eu sou|sou)[ \t]+"
     rf"(?P<name>{_TITLED})", True),
    # A greeting or sign-off addresses someone when punctuation or the end follows the name.
    (r"(?<!\p{L})(?i:hi|hello|hey|dear|thanks|thank you|good (?:morning|afternoon|evening)|welcome|ciao|salve"
     r"|buongiorno|buonasera|grazie|gentile|caro|cara|bonjour|bonsoir|salut|merci|cher|chère|hola|buenos días"
     r"|buenas tardes|gracias|estimado|estimada|hallo|guten tag|guten morgen|danke|liebe|lieber|olá|oi"
     r"|obrigado|obrigada|best regards|kind regards|best|regards|cheers|sincerely|cordialement|cordiali saluti"
     r"|saluti|saludos|un saludo|atentamente|viele grüße|grüße|atenciosamente"
     # An apology or a yes that addresses the user ("I am very sorry, Tom.").
     r"|sorry|okay|ok|sure|of course|bye|goodbye|take care|scusa|scusi|mi dispiace|désolé|désolée"
     r"|lo siento|perdón|entschuldigung|tut mir leid|desculpe)[ \t]*,?\s+"
     rf"(?P<name>{_TITLED})(?=[ \t]*(?:[,!.?:;)\n]|$))", True),
    (rf"(?<!\p{{L}}){_HONORIFIC}[ \t]+(?P<name>{_TITLED})", False),
    # A name field in a tool's JSON arguments or result.
    (r'"(?i:first_?name|last_?name|full_?name|given_?name|family_?name|surname|customer_?name|patient_?name'
     r'|contact_?name|nome|cognome|pr[ée]nom|nombre|apellidos?|vorname|nachname)"\s*:\s*"(?P<name>[^"\n]{2,60})"',
     False),
)]


def _title_case_line(s: str, start: int, end: int) -> bool:
    """True when most words near ``s[start:end]`` on its line are capitalised: then capitals tell nothing."""
    # Look for the line's ends only that far: a text of one long line would be read again for each cue.
    near_start, near_end = max(start - 80, 0), min(end + 80, len(s))
    line_start, line_end = s.rfind("\n", near_start, start) + 1, s.find("\n", end, near_end)
    rest = s[max(line_start, near_start):start] + " " + s[end:near_end if line_end < 0 else line_end]
    # Two letters and more: "I" is always capitalised.
    words = regex.findall(r"\p{L}{2,}", _PLACEHOLDER.sub(" ", rest))
    return len(words) >= 3 and sum(w[0].isupper() for w in words) >= 0.6 * len(words)


def _cue_names(s: str) -> Iterator[str]:
    """The names the cues in ``s`` introduce."""
    for pattern, weak in _CUES:
        for m in pattern.finditer(s):
            if weak and _title_case_line(s, *m.span("name")):
                continue
            words: list[str] = []
            for w in m.group("name").split():
                if w.casefold() in _PARTICLES and words:  # "Giovanni De Luca", "Anna de la Cruz"
                    words.append(w)
                elif w.casefold().rstrip(".") in _STOP:
                    break
                else:
                    words.append(w)
            while words and words[-1].casefold() in _PARTICLES:
                words.pop()
            if words:
                yield " ".join(words).removesuffix("'s").removesuffix("’s")


_WORD = regex.compile(r"[\p{L}\p{N}_]+")
# A name reads as words, runs of space (any run matches any other) and other characters one by one.
_TOKEN = regex.compile(r"([\p{L}\p{N}_]+)|(\s+)|.", regex.DOTALL)
_LEAD = regex.compile(r"^[^\p{L}\p{N}_]+")


def _token_key(token: regex.Match[str]) -> str:
    return " " if token.group(2) else token.group().casefold()  # casefold: "Strauss" also finds "Strauß"


class _Names:
    """Names to replace, each with its parts (a first name, a surname), found whole word and whatever the case.

    A trie of tokens: finding them costs a look-up for each word of the text, however many names there are
    (one regex alternation of all of them tried each name at each word).
    """

    def __init__(self) -> None:
        self._next: dict[tuple[int, str], int] = {}  # (node, token) -> node; the root is 0
        self._full: dict[int, str] = {}  # node where a name or part ends -> the full name, casefolded
        self.version = 0  # names or parts added so far

    def __bool__(self) -> bool:
        return bool(self._full)

    def copy(self) -> _Names:
        other = _Names()
        other._next, other._full, other.version = dict(self._next), dict(self._full), self.version
        return other

    def add(self, name: str, *, given: bool) -> None:
        """Add the name and its parts; a name or part added before keeps the full name it had."""
        name = " ".join(_PLACEHOLDER.sub(" ", name).split())  # a cue read in a redacted text names nobody
        if len(name) < 2 or "@" in name or not regex.search(r"\p{L}", name):
            return  # an email is the email detector's; an id of digits alone would redact every such number
        # A name given as an id ("anna.rossi") splits on dots and underscores as well.
        parts = [p for p in regex.split(r"[\s._]+" if given else r"\s+", name) if len(p) > 1
                 and regex.search(r"\p{L}", p) and p.casefold() not in _PARTICLES and p.casefold() not in _STOP]
        for variant in [name, *parts]:
            # Starting at a word, as the text is searched from each word: "(Anna)" is found as "Anna)".
            variant = _LEAD.sub("", variant)
            if len(variant) < 2:
                continue
            node = 0
            for token in _TOKEN.finditer(variant):
                node = self._next.setdefault((node, _token_key(token)), len(self._next) + 1)
            if node not in self._full:
                self._full[node] = name.casefold()
                self.version += 1

    def find(self, s: str, _covered: _Covered) -> Iterator[tuple[int, int, str]]:
        """(start, end, full name) of each name or part in ``s``: from left to right, the longest at a word."""
        after = 0
        for word in _WORD.finditer(s):
            node = self._next.get((0, word.group().casefold())) if word.start() >= after else None
            at, hit, full = word.end(), 0, ""
            while node is not None:
                if node in self._full and not _WORD.match(s, at):  # a whole word: "Anna" is not in "Annabel"
                    hit, full = at, self._full[node]
                token = _TOKEN.match(s, at)
                if token is None:
                    break
                node, at = self._next.get((node, _token_key(token))), token.end()
            if hit:
                yield word.start(), hit, full
                after = hit


# --- the redactor -----------------------------------------------------------------------------

# In order of precedence: where two matches overlap, config patterns win, then the earlier detector here,
# and learned names come last.
_DETECTORS: dict[str, _Detector] = {"email": _emails, "iban": _ibans, "card": _cards,
                                    "national_id": _national_ids, "phone": _phones, "address": _addresses}
_MAX_PASSES = 4  # a replacement can expose a shorter match beside it; text() goes again until none is left


def _compile_patterns(patterns: Mapping[str, str]) -> list[tuple[str, _Detector]]:
    compiled = []
    for name, pattern in patterns.items():
        if not _PATTERN_NAME.fullmatch(name) or name.lower() in _PREFIX:
            raise ValueError(f"redaction pattern {name!r}: a name is letters, digits and _, and not one of "
                             f"{', '.join(_PREFIX)}")
        try:
            rx = regex.compile(pattern)
        except (regex.error, TypeError) as e:
            raise ValueError(f"redaction pattern {name!r}: not a valid regular expression ({e}): {pattern!r}") from e
        if rx.fullmatch(""):
            raise ValueError(f"redaction pattern {name!r}: matches the empty string: {pattern!r}")
        compiled.append((name, _pattern_detector(name, rx)))
    return compiled


def _pattern_detector(name: str, rx: regex.Pattern[str]) -> _Detector:
    def find(s: str, _covered: _Covered) -> Iterator[tuple[int, int, str]]:
        try:
            for m in rx.finditer(s, timeout=PATTERN_TIMEOUT):
                yield m.start(), m.end(), m.group()
        except TimeoutError as e:
            raise TimeoutError(f"redaction pattern {name!r} ran longer than {PATTERN_TIMEOUT}s "
                               f"on a {len(s)}-character text") from e
    return find


class Redactor:
    """Consistent placeholders for one document (a scenario, or one exported conversation).

    Lifecycle: make one per document, :meth:`learn` from every message (or call :meth:`record`,
    which does), then redact with :meth:`text`, :meth:`value` or :meth:`record`; check a text
    written later (a model's draft) with :meth:`findings`. Placeholders are numbered in the order
    values are first replaced, so redacting the same document the same way gives the same output.

    Args:
        patterns: extra detectors, config name -> regular expression (``scenarios.redact.patterns``).
        names: names given for the person (``user.name``, ``enduser.id``), redacted wherever they occur.

    Raises:
        ValueError: a pattern does not compile, matches the empty string, or has a bad name.
    """

    def __init__(self, patterns: Mapping[str, str] | None = None, names: Iterable[str] = ()) -> None:
        self._patterns = _compile_patterns(patterns or {})
        self._names = _Names()
        self._seen: dict[str, list[tuple[int, int, str, str]]] = {}  # see _detect
        self._cued: dict[str, tuple[str, ...]] = {}  # text -> the names its cues introduce: texts repeat (histories)
        self._seen_version = 0
        self._placeholders: dict[tuple[str, str], str] = {}
        self._counts: dict[str, int] = {}
        for name in names:
            self._names.add(_skeleton(name)[0], given=True)

    def learn(self, texts: Iterable[str]) -> None:
        """Learn the names the cues in ``texts`` introduce; call it with every message before redacting."""
        for s in texts:
            self._learn(_skeleton(s)[0])

    def _learn(self, t: str) -> None:
        names = self._cued.get(t)
        if names is None:
            names = self._cued[t] = tuple(_cue_names(t))
        for name in names:
            self._names.add(name, given=False)

    def text(self, s: str, deadline: float | None = None) -> str:
        """``s`` with every detected value, and every learned name, replaced by its placeholder.

        Args:
            deadline: a ``time.monotonic()`` time to give up at; checked between detectors, so it can be
                passed by as long as one detector takes on the text.

        Raises:
            TimeoutError: a config pattern ran longer than ``PATTERN_TIMEOUT`` on ``s``, or ``deadline`` passed.
        """
        for _ in range(_MAX_PASSES):
            t, dropped = _skeleton(s)
            self._learn(t)  # again on each pass: a placeholder can change what a cue reads
            if self._names.version != self._seen_version:  # what was seen may hold names learned since
                self._seen, self._seen_version = {}, self._names.version
            found = _in_original(self._detect(t, self._names, deadline, self._seen), dropped)
            if not found:
                break
            out, at = [], 0
            for start, end, detector, key in found:
                out += [s[at:start], self._placeholder(detector, key)]
                at = end
            s = "".join(out) + s[at:]
        return s

    def value(self, v: Any, deadline: float | None = None) -> Any:
        """Strings redacted with :meth:`text`, dict values and list items recursively (keys kept), others as is.

        Args:
            deadline: as for :meth:`text`, for the whole of ``v``.
        """
        if isinstance(v, str):
            return self.text(v, deadline)
        if isinstance(v, dict):
            return {k: self.value(x, deadline) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [self.value(x, deadline) for x in v]
        return v

    def record(self, record: dict[str, Any]) -> dict[str, Any]:
        """A redacted copy of a conversation/v1 record.

        Learns from the record first (its messages, tool call arguments, system, and the names
        given in ``NAME_ATTRIBUTES``), then redacts message content, tool call arguments, system
        and attributes. Ids, roles, tool names, timestamps, span and trace ids are left as they are.
        """
        attributes = record.get("attributes") or {}
        for key in NAME_ATTRIBUTES:
            if isinstance(attributes.get(key), str):
                self._names.add(_skeleton(attributes[key])[0], given=True)
        messages = record.get("messages") or []
        self.learn([record.get("system") or "", *(m.get("content") or "" for m in messages),
                    *(json.dumps(c.get("arguments"), ensure_ascii=False)
                      for m in messages for c in m.get("tool_calls") or [])])
        out = dict(record)
        if isinstance(record.get("system"), str):
            out["system"] = self.text(record["system"])
        if "attributes" in record:
            out["attributes"] = self.value(record["attributes"])
        if "messages" in record:
            out["messages"] = [self._message(m) for m in messages]
        return out

    def counts(self) -> dict[str, int]:
        """Placeholders made so far, by detector (detectors that made none are left out)."""
        return dict(self._counts)

    def findings(self, s: str) -> list[Finding]:
        """What the detectors, the learned names and the name cues in ``s`` still match, in order.

        Placeholders never match. Empty for what :meth:`text` returns. Learns nothing.
        """
        t, dropped = _skeleton(s)
        names = self._names.copy()
        for name in _cue_names(t):
            names.add(name, given=False)
        return [Finding(detector, start, end)
                for start, end, detector, _ in _in_original(self._detect(t, names, None, {}), dropped)]

    def _message(self, message: dict[str, Any]) -> dict[str, Any]:
        out = dict(message)
        if isinstance(message.get("content"), str):
            out["content"] = self.text(message["content"])
        if message.get("tool_calls"):
            out["tool_calls"] = [{**c, "arguments": self.value(c.get("arguments"))} if "arguments" in c else c
                                 for c in message["tool_calls"]]
        return out

    def _placeholder(self, detector: str, key: str) -> str:
        if (detector, key) not in self._placeholders:
            n = self._counts[detector] = self._counts.get(detector, 0) + 1
            self._placeholders[detector, key] = f"<{_PREFIX.get(detector, detector.upper())}_{n}>"
        return self._placeholders[detector, key]

    def _detect(self, s: str, names: _Names, deadline: float | None,
                seen: dict[str, list[tuple[int, int, str, str]]]) -> list[tuple[int, int, str, str]]:
        """Non-overlapping (start, end, detector, key) in ``s``, by position; on overlap, precedence decides.

        ``seen`` holds what was found in each stretch of text between placeholders, which depends on
        nothing else while the names are the same: a stretch seen in an earlier pass, or in an earlier
        text, is not read again.
        """
        found: list[tuple[int, int, str, str]] = []
        # Detect between placeholders only, so a placeholder never matches nor joins two values.
        ends = [0, *(i for m in _PLACEHOLDER.finditer(s) for i in m.span()), len(s)]
        for at, end in zip(ends[::2], ends[1::2]):
            segment = s[at:end]
            if segment not in seen:
                seen[segment] = self._segment(segment, names, deadline) if segment.strip() else []
            found += ((at + start, at + end, detector, key) for start, end, detector, key in seen[segment])
        return found

    def _segment(self, s: str, names: _Names, deadline: float | None) -> list[tuple[int, int, str, str]]:
        taken = bytearray(len(s))  # 1 where a value was accepted: a match is checked on its span, not on each value

        def covered(start: int, end: int) -> bool:
            return taken.find(0, start, end) < 0

        accepted: list[tuple[int, int, str, str]] = []
        for detector, find in [*self._patterns, *_DETECTORS.items(), *([("person", names.find)] if names else [])]:
            _check(deadline)
            # The detector's matches, the earliest and then the longest first, where none found before overlaps.
            for start, end, key in sorted(find(s, covered), key=lambda f: (f[0], f[0] - f[1])):
                if end > start and taken.find(1, start, end) < 0:
                    taken[start:end] = b"\1" * (end - start)
                    accepted.append((start, end, detector, key))
        return sorted(accepted)


def _check(deadline: float | None) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise TimeoutError("redaction ran past its deadline")


def detect(s: str, patterns: Mapping[str, str] | None = None) -> list[Finding]:
    """What the detectors (and the name cues in ``s``) match in ``s``, with no names learned before."""
    return Redactor(patterns).findings(s)
